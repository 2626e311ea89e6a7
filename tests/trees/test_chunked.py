"""Rows longer than a chunk train in chunks, exactly: float64 against the call-by-call reference."""
import pytest
import torch

from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.chunked import backward_packed, chunk_bounds
from gyre_hpc.trees.loss import StepWeights
from gyre_hpc.trees.packing import collate, pack
from gyre_hpc.trees.reference import reference_loss

CLIP = 0.2
REWARDS = [0.0, 1.0, 0.5, 0.25]
TASKS = ["a", "a", "b", "b"]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=21).double()


def _grads(model):
    g = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return g


def _assert_close(loss, grads, ref_loss, ref_grads, rel=1e-10):
    assert abs(loss - ref_loss) <= rel * abs(ref_loss)
    for g, r in zip(grads, ref_grads):
        assert torch.linalg.vector_norm(g - r) <= rel * torch.linalg.vector_norm(r)


def _setup(model, make_journal):
    journals = [make_journal(300 + i, n_calls=20) for i in range(4)]
    trees = [build_tree(j, run_id=f"r{i}", task_id=TASKS[i], reward=REWARDS[i]) for i, j in enumerate(journals)]
    model.zero_grad()
    ref_loss, _ = reference_loss(model, journals, REWARDS, TASKS, CLIP)
    ref_loss.backward()
    return trees, float(ref_loss.detach()), _grads(model)


@pytest.mark.parametrize("attention", ["sdpa", "invariant"])
def test_invariant_tree_attention_gives_the_reference_loss_and_gradient(model, make_journal, attention):
    """The invariant kernels (bitwise the engine's numbers) are also the right numbers: the
    call-by-call float64 reference's loss and gradient, plain and in chunks."""
    trees, ref_loss, ref_grads = _setup(model, make_journal)
    weights = StepWeights.from_trees(trees)
    for chunk in (None, 37):
        rows = pack(trees, 10_000 if chunk is None else chunk)
        total = sum(backward_packed(model, collate([row]), weights, CLIP, attention, chunk_tokens=chunk)
                    for row in rows)
        _assert_close(total, _grads(model), ref_loss, ref_grads)


@pytest.mark.parametrize("chunk", [13, 64])
def test_paths_longer_than_a_row_train_in_chunks_exactly(model, make_journal, chunk):
    trees, ref_loss, ref_grads = _setup(model, make_journal)
    rows = pack(trees, chunk)
    assert all(r.n_tokens == t.n_tokens for r, t in zip(rows, trees))  # every tree is deeper than a chunk
    assert max(r.n_tokens for r in rows) > 4 * chunk
    weights = StepWeights.from_trees(trees)
    total = sum(backward_packed(model, collate([row]), weights, CLIP, "sdpa", chunk_tokens=chunk) for row in rows)
    assert abs(ref_loss) > 1e-3
    _assert_close(total, _grads(model), ref_loss, ref_grads)


def test_chunked_rows_under_any_micro_batch_split(model, make_journal):
    trees, ref_loss, ref_grads = _setup(model, make_journal)
    weights = StepWeights.from_trees(trees)
    rows = pack(trees, 40)
    assert len(rows) == 4 and min(r.n_tokens for r in rows) > 80
    # Two rows per micro-batch, padded together, in reverse order; then every row alone.
    for micro_batches in ([[3, 2], [1, 0]], [[0], [1], [2], [3]]):
        total = sum(backward_packed(model, collate([rows[i] for i in mb]), weights, CLIP, "sdpa", chunk_tokens=40)
                    for mb in micro_batches)
        _assert_close(total, _grads(model), ref_loss, ref_grads)


def test_unchunked_path_equals_chunked(model, make_journal):
    trees, _, _ = _setup(model, make_journal)
    weights = StepWeights.from_trees(trees)
    batch = collate(pack(trees[:1], 10_000))
    whole = backward_packed(model, batch, weights, CLIP, "sdpa")
    g_whole = _grads(model)
    chunked = backward_packed(model, batch, weights, CLIP, "sdpa", chunk_tokens=50)
    _assert_close(chunked, _grads(model), whole, g_whole, rel=1e-12)


@pytest.mark.parametrize("chunk", [None, 50])
def test_checkpointed_layers_give_the_same_loss_and_gradient(model, make_journal, chunk):
    """train.activation_checkpointing recomputes each layer in the backward: the same step."""
    trees, _, _ = _setup(model, make_journal)
    weights = StepWeights.from_trees(trees)
    batch = collate(pack(trees[:2], 10_000))
    plain = backward_packed(model, batch, weights, CLIP, "sdpa", chunk_tokens=chunk)
    g_plain = _grads(model)
    again = backward_packed(model, batch, weights, CLIP, "sdpa", chunk_tokens=chunk, checkpoint_layers=True)
    _assert_close(again, _grads(model), plain, g_plain, rel=1e-12)


def test_chunk_bounds_cover_the_row():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(4, 4) == [(0, 4)]
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunk_bounds(4, 0)


@pytest.mark.gpu
def test_chunked_flex_on_gpu_equals_unchunked_sdpa(make_journal):
    journals = [make_journal(300 + i, n_calls=20) for i in range(2)]
    trees = [build_tree(j, run_id=f"r{i}", task_id="a", reward=float(i)) for i, j in enumerate(journals)]
    weights = StepWeights.from_trees(trees)
    model = build_model("tiny", seed=22).cuda()
    batch = collate(pack(trees[:1], 64), device="cuda")
    results = {}
    for backend, chunk in (("sdpa", None), ("flex", 64)):
        loss = backward_packed(model, batch, weights, CLIP, backend, chunk_tokens=chunk)
        results[backend] = (loss, [p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    assert abs(results["flex"][0] - results["sdpa"][0]) <= 1e-4 * abs(results["sdpa"][0])
    for a, b in zip(results["flex"][1], results["sdpa"][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)

"""The output head in chunks of tokens: the unchunked values and gradients, and no [N, V] logits."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gyre_hpc.models import invariant as inv
from gyre_hpc.models.decoder import LMConfig, build_model
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.chunked import backward_packed
from gyre_hpc.trees.loss import StepWeights, packed_loss, tree_loss
from gyre_hpc.trees.packing import collate, pack
from gyre_hpc.trees.token_logprobs import head_logprobs

CLIP = 0.2


def _inputs(n=37, d=24, v=300, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=dtype)
    return hidden, weight, targets, upstream


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


@pytest.mark.parametrize("chunk", [1, 5, 37, 1000])
def test_head_logprobs_equal_the_unchunked_head_with_its_gradients(chunk):
    hidden, weight, targets, upstream = _inputs()
    ref = F.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None])[:, 0]
    ref_dh, ref_dw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    got = head_logprobs(hidden, weight, targets, chunk_tokens=chunk)
    dh, dw = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    assert got.dtype == torch.float32 and got.shape == (37,)
    assert _max_rel(got, ref) <= 1e-6
    assert _max_rel(dh, ref_dh) <= 1e-5
    assert _max_rel(dw, ref_dw) <= 1e-5


def test_head_logprobs_gradient_is_exact_in_float64():
    """The recomputed backward is the head's true gradient, not an approximation of it."""
    hidden, weight, targets, upstream = _inputs(dtype=torch.float64)
    ref = F.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None])[:, 0]
    ref_dh, ref_dw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    got = head_logprobs(hidden, weight, targets, chunk_tokens=4)
    dh, dw = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    assert _max_rel(got, ref) <= 1e-14 and _max_rel(dh, ref_dh) <= 1e-13 and _max_rel(dw, ref_dw) <= 1e-13


def test_invariant_head_logprobs_are_the_same_bits_in_any_chunking():
    hidden, weight, targets, _ = _inputs(n=50, d=160)
    with torch.no_grad():
        whole = F.log_softmax(inv.linear(hidden, weight), dim=-1).gather(-1, targets[:, None])[:, 0]
        for chunk in (1, 7, 16, 50):
            assert torch.equal(head_logprobs(hidden, weight, targets, chunk, invariant=True), whole)
    # and with a graph: the forward's bits do not depend on autograd
    assert torch.equal(head_logprobs(hidden, weight, targets, 7, invariant=True).detach(), whole)


def test_head_logprobs_refuse_bad_input_naming_it():
    hidden, weight, targets, _ = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        head_logprobs(hidden, weight, targets, chunk_tokens=0)
    with pytest.raises(ValueError, match="targets"):
        head_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="hidden"):
        head_logprobs(hidden, weight[:, :-1], targets)


def _step(make_journal, vocab=None):
    model = build_model("tiny" if vocab is None else LMConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=1,
                                                               d_ff=32), seed=3)
    journal = make_journal(11, n_calls=12)
    if vocab is not None:   # spread the tokens over the large vocabulary
        journal = [type(c)((c.prompt * 37) % vocab, (c.output * 37) % vocab, c.logprobs) for c in journal]
    tree = build_tree(journal, run_id="r", task_id="t", reward=1.0)
    tree2 = build_tree(make_journal(12, n_calls=12) if vocab is None else journal[:6], run_id="s", task_id="t",
                       reward=0.0)
    return model, [tree, tree2], StepWeights.from_trees([tree, tree2])


@pytest.mark.parametrize("attention", ["sdpa", "invariant"])
def test_packed_loss_and_gradient_equal_the_full_logits_path(make_journal, attention):
    from gyre_hpc.trees.attention import tree_attention
    from gyre_hpc.trees.loss import invariant_kwargs

    model, trees, weights = _step(make_journal)
    batch = collate(pack(trees, 10_000))
    fn = tree_attention(attention, batch.subtree_end, needs_grad=True, position_ids=batch.position_ids)
    ref = tree_loss(model(batch.input_ids, batch.position_ids, attention_fn=fn, **invariant_kwargs(fn)),
                    batch, weights, CLIP)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    got = packed_loss(model, batch, weights, CLIP, attention, logit_chunk_tokens=9)
    grads = torch.autograd.grad(got, list(model.parameters()))
    ref, got = float(ref.detach()), float(got.detach())
    assert abs(ref) > 1e-4
    assert abs(got - ref) <= 1e-6 * abs(ref)
    for g, r in zip(grads, ref_grads):
        assert _max_rel(g, r) <= 1e-5


class _LargestVocabRows(TorchDispatchMode):
    """The most rows any float tensor with a last dimension of ``vocab`` had, forward or backward."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("row_chunk", [None, 40])
def test_a_training_step_never_holds_more_than_a_chunk_of_logit_rows(make_journal, row_chunk):
    """Against the [T, V] the full-logits path builds (the same probe sees it there)."""
    vocab = 4099   # no other dimension of the model is this size
    model, trees, weights = _step(make_journal, vocab)
    batch = collate(pack(trees, 10_000))
    assert batch.shape[1] > 100 and int(batch.loss_mask.sum()) > 32
    full = _LargestVocabRows(vocab)
    with full:
        tree_loss(model(batch.input_ids, batch.position_ids), batch, weights, CLIP).backward()
    assert full.rows >= batch.shape[1]
    chunked = _LargestVocabRows(vocab)
    with chunked:
        backward_packed(model, batch, weights, CLIP, "sdpa", chunk_tokens=row_chunk, logit_chunk_tokens=16)
    assert 0 < chunked.rows <= 16

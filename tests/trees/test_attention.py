import warnings

import numpy as np
import pytest
import torch

from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.trees.attention import (FlexTreeAttention, SdpaTreeAttention, resolve_backend, tree_attention,
                                      tree_key_index, tree_mask_block)
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.loss import StepWeights, packed_loss, tree_loss
from gyre_hpc.trees.packing import collate, pack


def _batch(make_journal, row_tokens=300, n_rows=3, device="cpu"):
    trees = [build_tree(make_journal(s), run_id=f"r{s}", task_id="t", reward=float(s)) for s in range(3)]
    rows = pack(trees, row_tokens)
    return trees, rows, collate(rows[:n_rows], device=device)


def _dense_tree_mask(subtree_end):
    """The attention rule written out densely (test-only; small rows)."""
    L = subtree_end.shape[-1]
    q = torch.arange(L)[:, None]
    kv = torch.arange(L)[None, :]
    return ((kv <= q) & (q < subtree_end[:, None, :]))[:, None]


def test_mask_blocks_cover_reachable_keys_only_never_dense(make_journal):
    trees, _, batch = _batch(make_journal, row_tokens=1200, n_rows=2)
    B, L = batch.shape
    attn = SdpaTreeAttention(batch.subtree_end, block=64)
    deepest = max(t.path(c).size for t in trees for c in range(t.n_paths))
    _, _, q_block, n_keys = attn.largest_mask_block
    assert 1164 < L <= 1200 and q_block == 64
    assert n_keys <= deepest + 64 < L  # ancestors + the block, not the row
    # Without key selection a block spans keys [0, q_end): still never T x T.
    assert tree_mask_block(batch.subtree_end, 0, 64).shape == (B, 1, 64, 64)
    index, valid = tree_key_index(batch.subtree_end, 1100, 1164)
    for b in range(B):  # selected keys are exactly those some query of the block sees
        dense = _dense_tree_mask(batch.subtree_end[b:b + 1])[0, 0, 1100:1164]
        seen = torch.nonzero(dense.any(0)).flatten().tolist()
        assert index[b][valid[b]].tolist() == seen


def test_sdpa_tree_attention_equals_dense_masked_attention(make_journal):
    _, _, batch = _batch(make_journal)
    model = build_model("tiny", seed=2).double()
    dense = model(batch.input_ids, batch.position_ids, attn_mask=_dense_tree_mask(batch.subtree_end))
    for block in (1, 37, 256, 4096):
        blocked = model(batch.input_ids, batch.position_ids, attention_fn=SdpaTreeAttention(batch.subtree_end, block))
        torch.testing.assert_close(blocked, dense, rtol=1e-12, atol=1e-12)


def test_tree_mask_is_ancestors_and_self(make_journal):
    trees, rows, _ = _batch(make_journal, row_tokens=10_000, n_rows=1)
    row = rows[0]
    mask = _dense_tree_mask(torch.from_numpy(row.subtree_end)[None])[0, 0].numpy()
    # Brute force from the row's own predecessor chains: q sees kv iff kv is on q's path in this row.
    for q in range(0, row.n_tokens, 7):
        path = set()
        t = q
        while t >= 0:
            path.add(t)
            t = row.pred_index[t]
        np.testing.assert_array_equal(np.flatnonzero(mask[q]), sorted(path))


def test_recomputed_and_kept_blocks_give_the_same_gradient(make_journal):
    trees, _, batch = _batch(make_journal)
    weights = StepWeights.from_trees(trees)
    model = build_model("tiny", seed=3).double()
    grads = []
    for recompute in (True, False):
        logits = model(batch.input_ids, batch.position_ids,
                       attention_fn=SdpaTreeAttention(batch.subtree_end, 64, recompute=recompute))
        tree_loss(logits, batch, weights, 0.2).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_flex_forward_agrees_with_sdpa_on_cpu(make_journal):
    _, _, batch = _batch(make_journal)
    model = build_model("tiny", seed=4).double()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is slow; it is still exact
        flex = model(batch.input_ids, batch.position_ids, attention_fn=FlexTreeAttention(batch.subtree_end))
        sdpa = model(batch.input_ids, batch.position_ids, attention_fn=SdpaTreeAttention(batch.subtree_end))
    torch.testing.assert_close(flex, sdpa, rtol=1e-10, atol=1e-10)


def test_backend_switch():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("auto", "cuda") == "flex"
    assert resolve_backend("flex", "cpu", needs_grad=False) == "flex"
    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_backend("flex", "cpu", needs_grad=True)
    with pytest.raises(ValueError, match="valid backends are auto, sdpa, flex"):
        resolve_backend("dense", "cpu")
    end = torch.arange(1, 5)[None]
    assert isinstance(tree_attention("auto", end), SdpaTreeAttention)
    assert isinstance(tree_attention("flex", end, needs_grad=False), FlexTreeAttention)


@pytest.mark.gpu
def test_flex_backward_on_gpu_equals_sdpa(make_journal):
    trees, _, batch = _batch(make_journal, device="cuda")
    weights = StepWeights.from_trees(trees)
    model = build_model("tiny", seed=5).cuda()
    results = {}
    for backend in ("flex", "sdpa"):
        loss = packed_loss(model, batch, weights, 0.2, attention=backend)
        loss.backward()
        results[backend] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], rtol=1e-4, atol=1e-6)
    for a, b in zip(results["flex"][1], results["sdpa"][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs (distinct storages)."""
    seen = {}

    def pack_hook(t):
        if t.device.type == "cpu" and t.numel():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        fn()
    return sum(seen.values())


def test_recomputed_attention_keeps_memory_linear_in_the_row():
    """One long path: kept block probabilities grow as T^2, recomputed blocks as T."""
    model = build_model("tiny", seed=1)
    saved = {}
    for recompute in (False, True):
        for n in (1024, 4096):
            ids = torch.randint(0, 256, (1, n))
            pos = torch.arange(n)[None]
            end = torch.full((1, n), n)  # a single path: everything sees everything before it
            attn = SdpaTreeAttention(end, block=128, recompute=recompute)
            saved[recompute, n] = _saved_bytes(lambda: model(ids, pos, attention_fn=attn).sum())
    assert saved[False, 4096] > 6 * saved[False, 1024]               # quadratic when kept (8.5x)
    assert saved[True, 4096] < 4.4 * saved[True, 1024]               # linear when recomputed (3.9x)
    assert saved[True, 4096] < saved[False, 4096] / 2


def test_grouped_query_heads_are_expanded_inside_tree_attention():
    """Query heads sharing KV heads (a GQA model) are expanded inside the tree attention."""
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 8, dtype=torch.float64, requires_grad=True)
    end = torch.tensor([[6, 6, 4, 4, 6, 6]])
    out = SdpaTreeAttention(end, block=4)(q, k, v)
    dense = (torch.arange(6)[None, :] <= torch.arange(6)[:, None]) & (torch.arange(6)[:, None] < end[0][None, :])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=dense)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(dense[3].numpy(), [1, 1, 1, 1, 0, 0])


def test_chunk_queries_over_earlier_keys_agree_between_flex_and_sdpa(make_journal):
    """The last queries of a row over all keys before them: the chunked-training shape."""
    _, _, batch = _batch(make_journal, n_rows=1)
    L = batch.shape[1]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, L, 16, generator=g, dtype=torch.float64) for _ in range(3))
    full = SdpaTreeAttention(batch.subtree_end, block=32)(q, k, v)
    s = L // 3
    tail = SdpaTreeAttention(batch.subtree_end, block=32)(q[:, :, s:], k, v)
    torch.testing.assert_close(tail, full[:, :, s:], rtol=1e-12, atol=1e-12)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = FlexTreeAttention(batch.subtree_end, q_len=L - s, kv_len=L)(q[:, :, s:], k, v)
    torch.testing.assert_close(flex, full[:, :, s:], rtol=1e-10, atol=1e-10)


@pytest.mark.gpu
def test_flex_training_memory_is_linear_in_row_length():
    model = build_model("tiny", seed=6).cuda()
    added = {}
    for n in (8192, 32768):
        end = torch.full((1, n), n, device="cuda")  # one path: the densest tree there is
        ids = torch.randint(0, 256, (1, n), device="cuda")
        pos = torch.arange(n, device="cuda")[None]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(ids, pos, attention_fn=FlexTreeAttention(end)).float().square().mean().backward()
        torch.cuda.synchronize()
        added[n] = torch.cuda.max_memory_allocated() - base
        model.zero_grad(set_to_none=True)
    assert added[32768] < 4 * 1.3 * added[8192], added

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
    attn = SdpaTreeAttention(batch.subtree_end, block=64)  # blocks are planned once per batch
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


def test_recomputed_and_kept_masks_give_the_same_gradient(make_journal):
    trees, _, batch = _batch(make_journal)
    weights = StepWeights.from_trees(trees)
    model = build_model("tiny", seed=3).double()
    grads = []
    for recompute in (True, False):
        logits = model(batch.input_ids, batch.position_ids,
                       attention_fn=SdpaTreeAttention(batch.subtree_end, 64, recompute_masks=recompute))
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

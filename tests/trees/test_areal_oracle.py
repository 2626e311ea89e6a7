"""AReaL's tree packing as an outside oracle (``areal/models/tree_attn/tree.py``).

The same call sequences go to AReaL's ``build_packed_tree_batch`` and to our
``group_forest`` + ``pack``. Checked: the same stored tokens (each distinct prefix once),
every token's position id, every token attending exactly the tokens AReaL's mask lets it
attend; and, with ``shared_targets: per_sample`` and ``averaging: global``, the same loss and
gradient (float64) as AReaL's ``ppo_actor_loss_fn`` over its per-sequence log-probs: AReaL
trains every output token of every sequence, each with its own behaviour logprob, and
divides by all of them. Our ``once`` rule trains fewer targets than AReaL (the issue's
minimal case: 2 against 4), which is asserted too.

AReaL's package imports a GPU-oriented stack (aiohttp, hydra, transformers, ...); where
it is not installed the test skips. docs/trees.md records how it was run and what it printed.
"""
import os

import numpy as np
import pytest
import torch

areal_tree = pytest.importorskip(
    "areal.models.tree_attn.tree",
    reason="AReaL (pip install areal; its tree module needs its own dependency stack) is not installed")
areal_fn = pytest.importorskip("areal.utils.functional", reason="AReaL's loss functions did not import")
areal_tree_fn = pytest.importorskip("areal.models.tree_attn.functional", reason="AReaL's tree log-probs did not import")
from areal.api.cli_args import MicroBatchSpec  # noqa: E402

from gyre_hpc.models.tiny_lm import BOS_ID, build_model  # noqa: E402
from gyre_hpc.trees.builder import build_tree, group_forest  # noqa: E402
from gyre_hpc.trees.loss import StepWeights, packed_loss  # noqa: E402
from gyre_hpc.trees.model import ModelCall  # noqa: E402
from gyre_hpc.trees.packing import collate, pack  # noqa: E402

CLIP = 0.2
# AReaL compiles its log-prob gather with torch.compile; run it eagerly on CPU.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def _journals(make_journal):
    task = [BOS_ID, 10, 11, 12, 13]
    lp = lambda *v: np.float32(v)  # noqa: E731
    minimal = [ModelCall([BOS_ID, 1, 2], [3, 4], lp(-0.7, -1.1)), ModelCall([BOS_ID, 1, 2], [3, 4], lp(-0.9, -1.3))]
    listed = [
        ModelCall(task, [20, 21, 22], lp(-0.5, -0.6, -0.7)),
        ModelCall(task, [20, 21, 22], lp(-0.4, -0.8, -0.2)),
        ModelCall(task, [20, 21, 30, 31], lp(-0.45, -0.5, -1.0, -0.3)),
        ModelCall(task + [20, 21, 22, 40, 41], [], lp()),
        ModelCall(task + [20, 21, 22, 40, 41], [50, 51], lp(-0.9, -0.1)),
        ModelCall([BOS_ID, 60, 20, 21, 22], [52], lp(-0.3), role="summary"),
    ]
    return [minimal, listed, make_journal(7, n_calls=12), make_journal(8, n_calls=12)]


def _areal_batch(calls):
    seqs = [np.concatenate([c.prompt, c.output]).astype(np.int64) for c in calls]
    width = max(s.size for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, :s.size] = torch.from_numpy(s)
        mask[i, :s.size] = True
    total = sum(s.size for s in seqs)
    spec = MicroBatchSpec(max_tokens_per_mb=128 * (total // 128 + 1))
    batch = areal_tree.build_packed_tree_batch({"input_ids": ids, "attention_mask": mask}, spec)
    assert len(batch.mbs) == 1, "everything must land in one AReaL trie for a token-by-token comparison"
    mb = batch.mbs[0]
    trie, n = mb["trie_node"], batch.group_lens[0]
    dense = areal_tree.build_attention_mask_from_trie(trie, n, torch.device("cpu"))
    parent = areal_tree.trie_to_parent_array(trie, n)[0].long()
    return mb["input_ids"][0, :n], mb["position_ids"][0, :n], dense, parent, trie, seqs


def _paths(tokens, pred):
    """A token's identity in either layout: the token path from its root to it."""
    out: list[tuple] = []
    for i, tok in enumerate(tokens):
        p = int(pred[i])
        out.append((out[p] if p >= 0 else ()) + (int(tok),))
    return out


@pytest.mark.slow
def test_areal_packs_the_same_tokens_positions_and_attention_and_the_same_loss(make_journal):
    model = build_model("tiny", seed=9).double()
    for calls in _journals(make_journal):
        ids, pos, dense, parent, trie, seqs = _areal_batch(calls)
        # Ours: the hand-made journals as one run; the synthetic ones as two runs of one group
        # (split in half), packed as one group forest, as AReaL packs all sequences in one trie.
        half = len(calls) // 2
        runs = [calls] if len(calls) <= 6 else [calls[:half], calls[half:]]
        trees = [build_tree(r, run_id=f"r{i}", task_id="t", reward=float(i)) for i, r in enumerate(runs)]
        forest = group_forest(trees)
        (row,) = pack([forest], 1 << 16, "per_sample")

        # Stored tokens: the same set of distinct prefixes, each once.
        ours = _paths(row.input_ids, row.pred_index)
        theirs = _paths(ids.numpy(), parent.numpy())
        assert len(ours) == len(theirs) == forest.n_tokens
        assert len(set(ours)) == len(ours) and set(ours) == set(theirs)
        # Map AReaL index -> our row index through the shared path identity.
        index = {k: i for i, k in enumerate(ours)}
        m = np.array([index[k] for k in theirs])
        np.testing.assert_array_equal(row.input_ids[m], ids.numpy())
        np.testing.assert_array_equal(row.position_ids[m], pos.numpy())
        # Attention: AReaL's dense mask against our interval rule, all pairs.
        q, kv = np.meshgrid(m, m, indexing="ij")
        ours_mask = (kv <= q) & (q < row.subtree_end[kv])
        np.testing.assert_array_equal(ours_mask, dense.numpy())

        # Targets: AReaL trains every output token of every sequence; per_sample does too.
        outputs = sum(c.output.size for c in calls)
        assert row.n_samples == outputs
        (once,) = pack([forest], 1 << 16, "once")
        assert once.n_samples == int(sum(t.n_targets("once")[0] for t in trees)) <= outputs
        if len(calls) == 2:     # the minimal case: we train 2 positions, AReaL 4 tokens
            assert (row.n_loss_tokens, once.n_samples, row.n_samples) == (2, 2, 4)

        # Loss and gradient, float64: AReaL's per-sequence log-probs over its own layout and
        # mask, its PPO loss with a global token mean, against our packed loss.
        weights = StepWeights.from_trees(trees, "per_sample", "global")
        if len(runs) == 1:      # a lone run's group advantage is 0: give it one, so the loss is not 0
            weights = StepWeights(np.array([0.75]), weights.run_tokens, weights.n_runs, "global")
        adv = weights.advantages
        run_of_call = np.concatenate([np.full(len(r), i) for i, r in enumerate(runs)])
        model.zero_grad()
        logits = model(ids[None], pos[None], attn_mask=dense[None, None])[0]
        logp, old, a, loss_mask = [], [], [], []
        # AReaL's own gather: every sequence's log-probs, concatenated in sequence order; each
        # sequence gets one value per token, the last a transition past its end (not a target).
        assert trie.all_sequence_ids == list(range(len(calls)))
        ref32 = torch.split(areal_tree_fn.gather_packed_tree_logprobs(logits, trie, ids), [s.size for s in seqs])
        for sid, call in enumerate(calls):
            path = np.concatenate([np.arange(s, e + 1) for s, e in trie.get_sequence_tree_indices(sid)])
            assert path.size == seqs[sid].size
            lsm = torch.log_softmax(logits[path[:-1]], dim=-1)
            lp_seq = lsm.gather(-1, ids[path[1:]][:, None])[:, 0]
            # AReaL's own gather (float32 inside) agrees with the float64 one to float32 rounding.
            np.testing.assert_allclose(ref32[sid][:-1].double().detach().numpy(), lp_seq.detach().numpy(), atol=2e-5)
            is_out = torch.zeros(path.size - 1, dtype=torch.bool)
            if call.output.size:
                is_out[-call.output.size:] = True
            behaviour = torch.zeros(path.size - 1, dtype=torch.float64)
            behaviour[is_out] = torch.from_numpy(call.logprobs.astype(np.float64))
            logp.append(lp_seq)
            old.append(behaviour)
            a.append(torch.full((path.size - 1,), float(adv[run_of_call[sid]]), dtype=torch.float64))
            loss_mask.append(is_out)
        logp, old, a, loss_mask = map(torch.cat, (logp, old, a, loss_mask))
        theirs_loss, _ = areal_fn.ppo_actor_loss_fn(logp, old, old, a, CLIP, loss_mask)
        theirs_loss.backward()
        theirs_grads = [p.grad.detach().clone() for p in model.parameters()]
        model.zero_grad()
        ours_loss = packed_loss(model, collate([row]), weights, CLIP, "sdpa")
        ours_loss.backward()
        assert abs(theirs_loss.item()) > 1e-3
        assert abs(ours_loss.item() - theirs_loss.item()) <= 1e-12 * max(1e-12, abs(theirs_loss.item()))
        for g, r in zip((p.grad for p in model.parameters()), theirs_grads):
            assert torch.linalg.vector_norm(g - r) <= 1e-10 * max(1e-30, torch.linalg.vector_norm(r))
        model.zero_grad()
        print(f"areal-oracle calls={len(calls)} stored_tokens={forest.n_tokens} per_sample_targets={row.n_samples} "
              f"once_targets={once.n_samples} areal_loss_tokens={int(loss_mask.sum())} "
              f"loss_ours={ours_loss.item():.15g} loss_areal={theirs_loss.item():.15g}")

"""The trainer's logprobs over a tree equal the engine's behaviour logprobs, bit for bit.

Real journals: a TorchEngine (invariant mode, its default) runs agent-shaped calls (a
session whose prompts grow by output + tool text, so later calls reuse the retained KV; a
retry that branches from an earlier context; a sub-agent with a root of its own; several
requests batched together). Their trees are packed several ways (one row, small rows, group
forests, chunks of a long row) and the trainer's forward with ``attention="invariant"``
gives exactly the engine's numbers on every trained token, so an on-policy step has ratios
of exactly 1. The sdpa backend is the negative control: its numbers differ (in the last
bits) from the engine's.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre_hpc.engines import Request, SamplingParams
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.trees.attention import path_segments, tree_attention
from gyre_hpc.trees.builder import build_tree, group_forest
from gyre_hpc.trees.chunked import _chunk_batch, _forward_chunk, chunk_bounds
from gyre_hpc.trees.loss import invariant_kwargs, sample_logprobs
from gyre_hpc.trees.model import ModelCall
from gyre_hpc.trees.packing import collate, pack


def _sharp_model():
    model = build_model("tiny", seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(6.0)
    return model


def _run_calls(engine: TorchEngine, run: int) -> list[ModelCall]:
    """One run's journal from real engine calls: 5 main turns (retained context), a retry
    branching at turn 2, one sub-agent call; each turn's request batched with the others'."""
    rng = np.random.default_rng(run)
    prompt = [257] + rng.integers(0, 256, 20 + 7 * run).tolist()
    calls = []

    def call(ids, session, seed, n=12):
        out = engine.generate(Request(f"r{run}-{len(calls)}", tuple(ids), SamplingParams(n, seed=seed, stop_token_ids=()),
                                      session=session))
        calls.append(ModelCall(np.array(ids), np.array(out.token_ids), np.array(out.logprobs, np.float32)))
        return list(out.token_ids)

    branch = None
    for turn in range(5):
        out = call(prompt, f"run{run}", seed=100 * run + turn)
        prompt = prompt + out + rng.integers(0, 256, 9).tolist()   # tool text
        if turn == 1:
            branch = list(prompt)
    call(branch + [5, 6, 7], None, seed=999 + run, n=10)             # a retry from turn 2's context
    sub = [257, 9, 9] + rng.integers(0, 256, 15).tolist()
    out = engine.generate(Request(f"r{run}-sub", tuple(sub), SamplingParams(8, seed=7 + run, stop_token_ids=())))
    calls.append(ModelCall(np.array(sub), np.array(out.token_ids), np.array(out.logprobs, np.float32),
                           role="subagent", agent="sub1"))
    return calls


@pytest.fixture(scope="module")
def journals():
    model = _sharp_model()
    engine = TorchEngine(model, max_batch=16, prefill_chunk=16)
    # Keep other requests decoding beside every call, so batch shapes vary call by call.
    for i in range(6):
        engine.submit(Request(f"bg{i}", (257,) + tuple(range(40 + i, 60 + 3 * i)), SamplingParams(200, seed=i)))
    js = [_run_calls(engine, run) for run in range(4)]
    return model, js


def _trainer_logprobs(model, batch, attention: str) -> torch.Tensor:
    fn = tree_attention(attention, batch.subtree_end, needs_grad=False, position_ids=batch.position_ids)
    with torch.no_grad():
        logits = model(batch.input_ids, batch.position_ids, attention_fn=fn, **invariant_kwargs(fn))
    return sample_logprobs(logits, batch)


def _trees(js):
    return [build_tree(j, run_id=f"r{i}", task_id="t", reward=float(i)) for i, j in enumerate(js)]


@pytest.mark.parametrize("layout", ["one_row", "small_rows", "group_forest", "one_tree_per_row"])
def test_trainer_logprobs_equal_the_engines_bit_for_bit(journals, layout):
    model, js = journals
    trees = _trees(js)
    if layout == "group_forest":
        trees = [group_forest(trees[:2]), group_forest(trees[2:])]
    row_tokens = {"one_row": 1 << 16, "small_rows": 300, "group_forest": 1 << 16, "one_tree_per_row": 2}[layout]
    rows = pack(trees, row_tokens)
    for batch in ([collate(rows)] if layout != "one_tree_per_row" else [collate([r]) for r in rows]):
        got = _trainer_logprobs(model, batch, "invariant")
        assert got.numel() > 10
        assert torch.equal(got, batch.sample_logprobs), float((got - batch.sample_logprobs).abs().max())


def test_chunks_of_a_long_row_give_the_same_bits(journals):
    model, js = journals
    batch = collate(pack(_trees(js)[:1], 1 << 16))
    whole = _trainer_logprobs(model, batch, "invariant")
    got, past = [], None
    with torch.no_grad():
        for s, e in chunk_bounds(batch.shape[1], 50):
            logits, past = _forward_chunk(model, batch, s, e, past, "invariant")
            chunk = _chunk_batch(batch, s, e)
            if bool(chunk.loss_mask.any()):
                got.append(sample_logprobs(logits, chunk))
    chunked = torch.cat(got)
    assert torch.equal(torch.sort(chunked).values, torch.sort(whole).values)
    assert torch.equal(torch.sort(chunked).values, torch.sort(batch.sample_logprobs).values)


def test_sdpa_trainer_is_the_negative_control(journals):
    """The fast kernels agree only to rounding: what the invariant mode is for."""
    model, js = journals
    batch = collate(pack(_trees(js), 1 << 16))
    got = _trainer_logprobs(model, batch, "sdpa")
    gap = (got - batch.sample_logprobs).abs()
    assert float(gap.max()) < 1e-3 and float(gap.max()) > 0


def test_path_segments_list_each_runs_ancestors_by_depth():
    # Two roots; the first branches at depth 2 (tokens 3-4 under token 1), then a lone root.
    pos = np.array([0, 1, 2, 2, 3, 0, 1, 0])
    segs = [(s, e, k.tolist()) for s, e, k in path_segments(pos)]
    assert segs == [(0, 3, [0, 1, 2]), (3, 5, [0, 1, 3, 4]), (5, 7, [5, 6]), (7, 8, [7])]
    with pytest.raises(ValueError, match="depth 3"):
        path_segments(np.array([0, 1, 3]))

"""Must-show: the harness against a real TorchEngine over the real tiny model.

How the model is made to delegate, retry and compress without faking it: the fixture runs
the scripted teacher once to get its (prompt, output) pairs, then trains the real TinyLM on
them (teacher forcing, loss on output tokens only, a few seconds of Adam on CPU: a tiny
model overfits seven sequences fast) until its greedy choice is right on every output
token. The harness then drives the trained model through TorchEngine (greedy decoding,
continuous batching, its own KV cache) and must reproduce the whole trajectory: the model's
own outputs make the calls, the tools run for real, and the journal builds a valid tree.
"""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.harness.engine_client import EngineCalls, RunClient, call_seed
from gyre_hpc.harness.journal import load_journal
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.tokenizer import PAD
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.trees.builder import build_tree

from scripted import HI_TASK, ScriptClient

CFG = HarnessConfig(max_new_tokens=32, context_limit=230)

# Training the model in the fixture takes ~10 s alone and ~20 s on a busy 2-core machine.
pytestmark = pytest.mark.slow


def _teacher_calls(tmp_path_factory):
    d = tmp_path_factory.mktemp("teacher")
    r = asyncio.run(AgentRun(HI_TASK, d / "ws", ScriptClient(), d / "j.jsonl", CFG).run())
    assert (r.retries, r.compressions, r.delegations, r.reward) == (1, 1, 1, 1.0)
    return r.calls


def _train_to_reproduce(calls, seed=0, max_steps=400):
    torch.manual_seed(seed)
    seqs = [(np.concatenate([c.prompt, c.output]), c.prompt.size) for c in calls]
    width = max(s.size for s, _ in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    target = torch.zeros(len(seqs), width - 1, dtype=torch.bool)
    for i, (s, p) in enumerate(seqs):
        ids[i, : s.size] = torch.from_numpy(s.astype(np.int64))
        target[i, p - 1: s.size - 1] = True      # logits at t predict token t+1: outputs only
    pos = torch.arange(width).expand(len(seqs), width)
    model = build_model("tiny", seed=seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(max_steps):
        logits = model(ids, pos)[:, :-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -logp[target].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        # every output token the clear favourite (p > 0.6), so greedy decoding in the
        # engine (another kernel path, a KV cache) picks it too
        if logp[target].min().item() > -0.5:
            return model.eval(), step
    raise AssertionError(f"the tiny model did not learn the script in {max_steps} steps (loss {loss.item():.3f})")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(1)
    calls = _teacher_calls(tmp_path_factory)
    model, steps = _train_to_reproduce(calls)
    return model, calls


def _run(model, tmp_path, name, temperature=0.0, run_seed=0):
    driver = EngineCalls(TorchEngine(model), temperature=temperature)
    run = AgentRun(HI_TASK, tmp_path / f"ws-{name}", driver.client(run_seed), tmp_path / f"{name}.jsonl", CFG,
                   run_id=name)
    return asyncio.run(run.run())


def test_real_engine_run_delegates_retries_compresses_and_builds_a_valid_tree(trained, tmp_path):
    model, teacher = trained
    r = _run(model, tmp_path, "greedy")
    assert r.error is None, r.error
    assert (r.status, r.reward, r.retries, r.compressions, r.delegations) == ("finished", 1.0, 1, 1, 1)
    assert [c.output.tolist() for c in r.calls] == [c.output.tolist() for c in teacher]
    assert {(c.role, c.agent) for c in r.calls} == {("main", "main"), ("subagent", "sub1"), ("summary", "main")}
    state = load_journal(tmp_path / "greedy.jsonl")
    assert (state.status, state.reward, len(state.calls)) == ("finished", 1.0, len(r.calls))
    tree = build_tree(state.calls, run_id="greedy", task_id=HI_TASK.task_id, reward=state.reward)
    for i, c in enumerate(state.calls):
        assert np.array_equal(tree.path(i), np.concatenate([c.prompt, c.output]))
    # every generated token is trained exactly once; prompts that repeat outputs are context
    assert tree.trained.sum() == len({tuple(np.concatenate([c.prompt, c.output]).tolist()[:k + 1])
                                      for c in state.calls for k in range(c.prompt.size, c.prompt.size + c.output.size)})
    assert len(np.unique(tree.node_role)) == 3   # main, subagent and summary branches


def test_journal_logprobs_are_the_models_own(trained, tmp_path):
    model, _ = trained
    r = _run(model, tmp_path, "lp")
    call = r.calls[1]                              # a sub-agent call
    seq = torch.from_numpy(np.concatenate([call.prompt, call.output]).astype(np.int64))[None]
    with torch.no_grad():
        logits = model(seq, torch.arange(seq.shape[1])[None])
    logp = torch.log_softmax(logits[0, :-1].double(), -1)
    want = logp[torch.arange(call.prompt.size - 1, seq.shape[1] - 1), seq[0, call.prompt.size:]]
    np.testing.assert_allclose(call.logprobs, want.numpy(), atol=1e-4)
    assert (call.logprobs < 0).all()


def test_concurrent_runs_batch_on_one_engine_and_seeded_sampling_replays(trained, tmp_path):
    model, _ = trained
    engine = TorchEngine(model)
    driver = EngineCalls(engine, temperature=1.0)

    async def main(seeds, tag):
        runs = [AgentRun(HI_TASK, tmp_path / f"ws-{tag}{k}", driver.client(s), tmp_path / f"{tag}{k}.jsonl", CFG,
                         run_id=f"{tag}{k}") for k, s in enumerate(seeds)]
        return await asyncio.gather(*(r.run() for r in runs))

    first = asyncio.run(main([11, 12, 13], "a"))
    again = asyncio.run(main([11, 12, 13], "b"))
    for x, y in zip(first, again):
        assert x.error is None and x.status in ("finished", "timeout")
        assert [c.output.tolist() for c in x.calls] == [c.output.tolist() for c in y.calls]
        # batch composition moves float32 results in the last bits, nothing more
        for cx, cy in zip(x.calls, y.calls):
            np.testing.assert_allclose(cx.logprobs, cy.logprobs, atol=1e-5)
    assert engine.counters().requests_finished == sum(len(r.calls) for r in first + again)


def test_a_calls_seed_is_a_function_of_the_run_seed_and_the_prompt_alone():
    prompt = [5, 9, 2, 7]
    assert call_seed(3, prompt) == call_seed(3, list(prompt)) == RunClient(None, 3).seed_for(prompt)
    assert call_seed(3, prompt) != call_seed(4, prompt) and call_seed(3, prompt) != call_seed(3, prompt[:-1])
    assert 0 <= call_seed(3, prompt) < 2**63


class _Killed(BaseException):
    """The fleet died mid-run: not an Exception, so the loop writes no end record."""


class _KillAt:
    def __init__(self, inner, at):
        self.inner, self.at, self.k = inner, at, 0

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        k, self.k = self.k, self.k + 1
        if k == self.at:
            raise _Killed()
        return await self.inner.complete(prompt, max_new_tokens, stop, agent=agent)


def test_a_run_interrupted_mid_way_resumes_to_the_uninterrupted_runs_tree(trained, tmp_path):
    """Sampled (temperature 1, seeded per call), invariant numerics: cut after 4 calls and
    resumed on a fresh engine, the run's tree has the uninterrupted run's token arrays and
    logprobs bit for bit, and no journaled call goes to the engine again."""
    from gyre_hpc.harness.snapshot import SnapshotStore
    model, _ = trained
    whole = AgentRun(HI_TASK, tmp_path / "ws-whole", EngineCalls(TorchEngine(model), temperature=1.0).client(7),
                     tmp_path / "whole.jsonl", CFG, run_id="r")
    whole = asyncio.run(whole.run())
    assert whole.error is None and len(whole.calls) > 4
    store = SnapshotStore(tmp_path / "store", durable=False)

    def run(client):
        return AgentRun(HI_TASK, tmp_path / "ws-cut", client, tmp_path / "cut.jsonl", CFG, run_id="r",
                        snapshots=store, snapshot_every=2).run()
    with pytest.raises(_Killed):
        asyncio.run(run(_KillAt(EngineCalls(TorchEngine(model), temperature=1.0).client(7), 4)))
    engine = TorchEngine(model)
    resumed = asyncio.run(run(EngineCalls(engine, temperature=1.0).client(7)))
    assert not resumed.restarted and resumed.replayed == 4 and resumed.snapshot_call == 1
    assert engine.counters().requests_finished == len(whole.calls) - 4     # 0 journaled calls redone
    a, b = (build_tree(r.calls, run_id="r", task_id=HI_TASK.task_id, reward=r.reward) for r in (whole, resumed))
    assert a.n_tokens == b.n_tokens and np.array_equal(a.tokens, b.tokens)
    assert np.array_equal(a.logprobs.view(np.uint32), b.logprobs.view(np.uint32))
    assert (resumed.status, resumed.reward) == (whole.status, whole.reward)

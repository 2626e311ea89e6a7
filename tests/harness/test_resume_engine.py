"""Must-show (issue 53): a run cut mid-way and resumed from its journal has the uninterrupted
run's tree, on a real TorchEngine over the real tiny model (invariant kernels, sampling at
temperature 1 with each call's seed a function of (run seed, prompt)).

The resumed run gets a fresh engine, as a relaunched fleet would: a cold KV cache, so its
first live call prefills the whole context the uninterrupted run extended from its cache;
the invariant kernels make that the same bits. The untrained model's outputs are text, so its
calls are ``answer`` tool calls that append to the answer file: every call changes the
workspace, and the context grows past ``context_limit`` so the run compresses too.
"""
from __future__ import annotations

import asyncio

import numpy as np
import torch

from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.harness.engine_client import EngineCalls
from gyre_hpc.harness.journal import load_journal
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.snapshot import SnapshotStore
from gyre_hpc.harness.tasks import Task, TaskTest
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.trees.builder import build_tree

from workspace_tree import tree

TASK = Task(task_id="resume-engine", spec="Write notes.", files={"notes.txt": "n"},
            tests=(TaskTest("has_notes", "import os\nassert os.path.isfile('notes.txt')"),), max_turns=14)
CFG = HarnessConfig(max_new_tokens=12, context_limit=320, run_timeout_s=600)
RUN_SEED = 7


class Killed(BaseException):
    """The fleet died: not an Exception, so the loop cannot catch it (no end record)."""


class Metered:
    """A run's client that counts its engine calls and dies at call ``kill_at``."""

    def __init__(self, inner, kill_at: int | None = None):
        self.inner, self.kill_at, self.n = inner, kill_at, 0

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        if self.n == self.kill_at:
            raise Killed(f"call {self.n}")
        self.n += 1
        return await self.inner.complete(prompt, max_new_tokens, stop, agent=agent)


def _run(model, tmp_path, name, kill_at=None, store=None):
    """One run on a fresh engine (a fresh fleet); (result or None if killed, engine calls)."""
    client = Metered(EngineCalls(TorchEngine(model), temperature=1.0).client(RUN_SEED), kill_at)
    run = AgentRun(TASK, tmp_path / f"ws-{name}", client, tmp_path / f"{name}.journal", CFG, run_id=name,
                   snapshots=store, snapshot_every=4)
    try:
        return asyncio.run(run.run(resume=True)), client.n
    except Killed:
        return None, client.n


def test_run_cut_mid_way_resumes_to_the_uninterrupted_runs_tree_with_no_journaled_call_redone(tmp_path):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model("tiny", seed=0).eval()
    whole, n = _run(model, tmp_path, "whole")
    assert whole.status == "finished" and n == len(whole.calls) == TASK.max_turns + whole.compressions
    assert whole.compressions >= 1      # the cut below falls after a compression's branch

    cut = 9
    store = SnapshotStore(tmp_path / "store", durable=False)
    killed, made = _run(model, tmp_path, "cut", kill_at=cut, store=store)
    assert killed is None and made == cut
    state = load_journal(tmp_path / "cut.journal")
    assert state.status == "running" and len(state.calls) == cut and store.calls() == [3, 7]

    resumed, made = _run(model, tmp_path, "cut", store=store)
    print(f"resume-engine: {len(whole.calls)} calls, cut at {cut}, engine calls on resume {made}, "
          f"replayed {resumed.replayed}, snapshot {resumed.snapshot_call}, tools redone {resumed.tools_redone}")
    assert made == len(whole.calls) - cut          # no journaled call asked the engine again
    assert (resumed.replayed, resumed.snapshot_call, resumed.restarted) == (cut, 7, False)
    assert resumed.tools_redone == cut - 1 - 7      # only the calls after the snapshot
    assert (resumed.status, resumed.reward) == (whole.status, whole.reward)

    a = build_tree(whole.calls, reward=whole.reward)
    b = build_tree(load_journal(tmp_path / "cut.journal").calls, reward=resumed.reward)
    assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.parent, b.parent)
    assert np.array_equal(a.trained, b.trained) and np.array_equal(a.logprobs, b.logprobs)   # the same bits
    assert tree(tmp_path / "ws-cut", skip=("__pycache__",)) == tree(tmp_path / "ws-whole", skip=("__pycache__",))

"""Resume, not restart (issue 53): a fleet SIGKILLed while its runs are mid-way is relaunched,
and each unfinished run goes on from its journal and workspace snapshot; the runs table says
so (``resumed_calls``, ``tools_redone``, ``restarted_from_first``), and the step's trees in
trees.zarr are an uninterrupted fleet's with the same seeds, token for token and logprob bit
for bit (TorchEngine, invariant numerics; one step, so every call is of policy version 0)."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from gyre_hpc.harness.journal import JournalError, load_journal
from gyre_hpc.jobs.launchers import LocalLauncher
from gyre_hpc.jobs.plan import local_plan
from gyre_hpc.jobs.supervisor import Supervisor
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import read_table
from gyre_hpc.trees.store import TreeStore
from tests.rl.rl_helpers import program_argv, rl_config, store_run_ids, write_run_dir

pytestmark = pytest.mark.slow    # two fleet launches of runs of tens of calls: minutes on 2 cores

SNAPSHOT_EVERY = 4
MID_WAY = 6      # the kill waits for an unfinished journal with this many calls


def _unfinished_calls(journals) -> dict[str, int]:
    out = {}
    for p in journals.glob("*.journal"):
        try:
            state = load_journal(p)
        except (JournalError, OSError):
            continue        # being created this instant
        if not state.finished:
            out[p.stem] = len(state.calls)
    return out


def _supervisor(tmp_path, name):
    cfg = rl_config(tmp_path / name, "rollout.tasks=long", "train.steps=1",
                    f"rollout.snapshot_every={SNAPSHOT_EVERY}", "rollout.tool_latency_s=0.05")
    run = write_run_dir(cfg)
    return cfg, run, Supervisor(cfg=cfg, run=run, launcher=LocalLauncher(), plan=local_plan(cfg),
                                argv=program_argv(run), log=lambda m: None)


def _trees(run: RunDir) -> dict:
    with TreeStore.open(run.trees, "r") as store:
        return {t.run_id: t for t in (store.read(i) for i in range(len(store)))}


def test_fleet_killed_mid_run_resumes_its_runs_from_their_journals_to_the_uninterrupted_trees(tmp_path):
    cfg, run, sup = _supervisor(tmp_path, "killed")
    seen: dict[str, int] = {}

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not seen:
            time.sleep(0.1)
            mid = {r: n for r, n in _unfinished_calls(run.journals).items() if n >= MID_WAY}
            if sup.handle is not None and mid:
                seen.update(mid)
                os.kill(sup.handle.pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    result = sup.run_fleet()
    assert seen, "the fleet finished before a run was mid-way"
    assert result.status == "finished" and result.launches == 2
    per_step = cfg.rollout.tasks_per_step * cfg.rollout.runs_per_task
    ids = store_run_ids(run)
    assert len(ids) == per_step and len(set(ids)) == per_step
    runs = read_table(run.metrics, "runs")
    rows = {rid: i for i, rid in enumerate(runs["run_id"])}
    assert len(rows) == len(runs["run_id"]) == per_step                    # each run's row once
    resumed = [i for i in rows.values() if runs["resumed_calls"][i] > 0]
    print(f"killed with {seen} calls journaled; resumed runs: "
          f"{[(str(runs['run_id'][i]), int(runs['resumed_calls'][i]), int(runs['tools_redone'][i]), int(runs['calls'][i])) for i in resumed]}")
    for rid, n in seen.items():
        i = rows[rid]
        assert runs["resumed_calls"][i] >= n        # at least what was journaled when the kill was sent
    assert resumed and all(runs["tools_redone"][i] <= SNAPSHOT_EVERY for i in resumed)
    assert int(runs["restarted_from_first"].sum()) == 0
    assert not any((run.snapshots / rid).exists() for rid in rows)        # dropped once each run ended

    _, ref_run, ref = _supervisor(tmp_path, "whole")
    assert ref.run_fleet().launches == 1
    got, want = _trees(run), _trees(ref_run)
    assert sorted(got) == sorted(want)
    for rid, t in want.items():
        g = got[rid]
        assert np.array_equal(g.tokens, t.tokens) and np.array_equal(g.parent, t.parent), rid
        assert np.array_equal(g.trained, t.trained) and np.array_equal(g.logprobs.view(np.uint32),
                                                                        t.logprobs.view(np.uint32)), rid
        assert g.reward == t.reward, rid

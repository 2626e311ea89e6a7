"""An RL step whose runs an outside scaffold drives through the endpoint (``rollout.agent``):
real MPI ranks, engines behind the router, a task directory, trees.zarr read back against the
journals (every trained token is a token the engine sampled, exactly once)."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openai", reason="openai is not installed (the test extra)")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (the endpoint extra)")

from gyre_hpc.harness.confine import isolation_mode  # noqa: E402
from gyre_hpc.harness.journal import load_journal  # noqa: E402
from gyre_hpc.rundir.layout import RunDir  # noqa: E402
from gyre_hpc.trees.store import TreeStore  # noqa: E402
from tests.rl.rl_helpers import REPO, rl_config, run_fleet  # noqa: E402

SCRIPT = str(REPO / "tests/harness/scaffold_openai_client.py")

pytestmark = [pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (Open MPI)"),
              pytest.mark.skipif(isolation_mode() == "plain", reason="no namespace jail can be made here")]


def scaffold_step(tmp_path: Path, agent) -> tuple[RunDir, dict, str]:
    tasks = tmp_path / "tasks"
    shutil.copytree(REPO / "examples/tasks/add-two", tasks / "add-two")
    cfg = rl_config(tmp_path, rollout={"tasks": str(tasks), "runs_per_task": 2, "tasks_per_step": 1,
                                       "max_new_tokens": 12, "agent": agent, "run_timeout_s": 120.0},
                    train={"steps": 1})
    proc, result = run_fleet(cfg, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return RunDir.at(cfg.run_dir), result, proc.stdout


def trees_and_journals(run, count: int):
    """Each tree in the run's trees.zarr with its run's journal (the store holds ``count``)."""
    with TreeStore.open(run.trees, "r") as store:
        trees = [store.read(i) for i in range(len(store))]
    assert len(trees) == count
    return [(tree, load_journal(run.journals / f"{tree.run_id}.journal")) for tree in trees]


@pytest.mark.slow       # ~80 s here: a fleet of 4 MPI ranks, one step
def test_openai_script_runs_train_exactly_the_tokens_the_engines_sampled(tmp_path):
    run, _, stdout = scaffold_step(tmp_path, {"command": [sys.executable, SCRIPT, "turns"]})
    assert " step 1/1 reward " in stdout
    for tree, journal in trees_and_journals(run, 2):
        assert journal.finished and tree.reward == journal.reward == 1.0 and tree.status == "finished"
        calls = list(journal.calls)
        assert len(calls) == 3
        sampled = np.concatenate([c.output for c in calls])
        assert np.array_equal(tree.tokens[tree.trained], sampled)      # one path: in call order
        assert np.array_equal(tree.logprobs[tree.trained], np.concatenate([c.logprobs for c in calls]))
        for k, c in enumerate(calls):
            assert np.array_equal(tree.path(k), np.concatenate([c.prompt, c.output]))
        figures = json.loads((run.journals / f"{tree.run_id}.endpoint.json").read_text())
        assert (figures["calls"], figures["extends"], figures["drift"]) == (3, 2, 0)
        assert figures["sharing_ratio"] > 1.0 and figures["trained_tokens"] == sampled.size
        print(tree.run_id, json.dumps({k: figures[k] for k in ("calls", "drift", "sharing_ratio", "overhead_ms_mean",
                                                               "reward")}))


@pytest.mark.slow       # ~2 min here: the fleet, and litellm imported per run
@pytest.mark.miniswe
def test_mini_swe_agent_drives_every_run_of_a_step_and_trains_its_sampled_tokens(tmp_path):
    run, _, stdout = scaffold_step(tmp_path, "mini-swe-agent")
    assert " step 1/1 reward " in stdout
    for tree, journal in trees_and_journals(run, 2):
        calls = list(journal.calls)
        assert journal.finished and tree.reward == journal.reward and len(calls) >= 1
        for k, c in enumerate(calls):                       # every context exactly as the engine saw it
            assert np.array_equal(tree.path(k), np.concatenate([c.prompt, c.output]))
        sampled = sorted(int(t) for c in calls for t in c.output)
        assert int(tree.trained.sum()) == len(sampled) and sorted(tree.tokens[tree.trained].tolist()) == sampled
        figures = json.loads((run.journals / f"{tree.run_id}.endpoint.json").read_text())
        assert figures["drift"] == 0 and figures["calls"] == len(calls)
        print(tree.run_id, json.dumps({k: figures[k] for k in ("calls", "extends", "branches", "drift",
                                                               "sharing_ratio", "overhead_ms_p50", "reward")}))

"""Run shapes read back from a real trees.zarr (inspect's "shapes"), and bench trees --from on it."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from gyre_hpc.harness.loop import HarnessConfig
from gyre_hpc.harness.tasks import load_suite
from gyre_hpc.rundir.tree_stats import run_shapes, store_stats
from gyre_hpc.trees.admission import admit
from gyre_hpc.trees.store import TreeStore
from gyre_hpc.warmstart.trajectories import teacher_runs

CFG = HarnessConfig(max_new_tokens=176, context_limit=768, subagent_turns=6, tool_output_bytes=192,
                    run_timeout_s=600)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    tasks = [t for t in load_suite("long") if t.task_id in ("lh-stats", "lh-greet")]
    return teacher_runs(tasks, 1, CFG, workdir=tmp_path_factory.mktemp("teacher"))


def _store(path, trees):
    with TreeStore.open(path / "trees.zarr", "a") as store:
        store.append(trees)
    return TreeStore.open(path / "trees.zarr", "r")


def test_store_stats_count_every_behaviour_the_runs_had(tmp_path, teacher):
    with _store(tmp_path, teacher.trees) as store:
        ds = store.dataset()
        shapes = run_shapes(ds)
        stats = store_stats(ds)
    for shape, result in zip(shapes, teacher.results):
        assert shape["calls"] == len(result.calls) and shape["dropped_calls"] == 0
        assert shape["retries"] == result.retries == 1
        assert shape["compressions"] == result.compressions
        assert shape["subagent_calls"] == sum(c.role == "subagent" for c in result.calls)
        assert shape["expanded_tokens"] == sum(c.prompt.size + c.output.size for c in result.calls)
    calls = [len(r.calls) for r in teacher.results]
    assert stats["calls_per_run"]["mean"] == pytest.approx(np.mean(calls)) and stats["calls_per_run"]["max"] == max(calls)
    assert stats["runs_with"] == {"compression": 1.0, "subagent": 1.0, "retry": 1.0, "timeout": 0.0}
    expanded = sum(c.prompt.size + c.output.size for r in teacher.results for c in r.calls)
    assert stats["sharing_ratio"] == pytest.approx(expanded / sum(t.n_tokens for t in teacher.trees))
    assert stats["trained_share"] == pytest.approx(sum(int(t.trained.sum()) for t in teacher.trees) /
                                                   sum(t.n_tokens for t in teacher.trees))


def test_admission_drops_are_reported_and_never_counted_as_retries(tmp_path, teacher):
    admitted = [admit(t, 8) for t in teacher.trees]
    with _store(tmp_path, admitted) as store:
        stats = store_stats(store.dataset())
        shapes = run_shapes(store.dataset())
    dropped = sum(len(t.dropped_calls) for t in admitted)
    assert dropped > 0 and stats["admission"]["dropped_calls"] == dropped
    assert stats["admission"]["calls_total"] == sum(len(r.calls) for r in teacher.results)
    assert all(s["retries"] <= 1 and s["kept_calls"] == 8 for s in shapes)


@pytest.mark.slow
def test_bench_trees_from_a_run_trains_the_same_loss_both_ways(tmp_path, teacher):
    from gyre_hpc.bench.trees import command

    (tmp_path / "run").mkdir()
    # one advantage group with different rewards, so the loss is not trivially 0
    group = [dataclasses.replace(t, task_id="g", reward=r) for t, r in zip(teacher.trees, (0.25, 1.0))]
    _store(tmp_path / "run", group).close()
    out = CliRunner().invoke(command, ["--from", str(tmp_path / "run"), "--json", "--repeats", "1"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    expanded = sum(c.prompt.size + c.output.size for r in teacher.results for c in r.calls)
    assert report["tokens"]["expanded_paths"] == expanded
    assert report["tokens"]["ratio"] == pytest.approx(expanded / sum(t.n_tokens for t in teacher.trees))
    assert report["trained_tokens"]["per_path"] == report["trained_tokens"]["tree"]
    assert report["loss"]["tree"] != 0.0
    assert report["loss"]["per_path"] == pytest.approx(report["loss"]["tree"], rel=1e-4)

"""``gyre-hpc inspect`` on an rl run dir shows steps with rewards, the tree store, runs' flip effects."""
from __future__ import annotations

from gyre_hpc.config import build_config
from gyre_hpc.rundir.inspect import summarize
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter, RunRow, StepRow
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import ModelCall
from gyre_hpc.trees.store import TreeStore


def test_inspect_shows_rl_steps_trees_and_runs(tmp_path):
    run = RunDir.at(tmp_path / "run").make()
    cfg = build_config({"workload": "rl", "run_dir": str(run.root), "train": {"steps": 2}})
    run.config.write_text(cfg.to_yaml())
    with MetricsWriter(run.metrics) as m:
        m.add(StepRow(step=1, time=1.0, wall_s=2.0, tokens=40, replicas=2, loss=0.1, reward_mean=0.25))
        m.add(StepRow(step=2, time=3.0, wall_s=2.0, tokens=30, replicas=1, loss=0.2, reward_mean=0.75))
        m.append([RunRow(time=1.0, step=1, run_id="a", task_id="t", status="finished", reward=0.25, migrations=2),
                  RunRow(time=3.0, step=2, run_id="b", task_id="t", status="timeout", reward=0.75)])
    call = ModelCall([257, 1, 2], [3, 4], [-0.5, -0.25])
    with TreeStore.open(run.trees, "a", durable=False) as store:
        store.append([build_tree([call], run_id=r, task_id="t", reward=w) for r, w in (("a", 0.25), ("b", 0.75))])
    s = summarize(run.root)
    assert [(x["step"], x["reward_mean"], x["replicas"]) for x in s.steps] == [(1, 0.25, 2), (2, 0.75, 1)]
    shapes = s.trees.pop("shapes")
    assert s.trees == {"trees": 2, "unique_run_ids": 2, "trained_tokens": 4, "reward_mean": 0.5}
    assert shapes["calls_per_run"] == {"mean": 1.0, "p50": 1.0, "p90": 1.0, "max": 1}
    assert shapes["sharing_ratio"] == 1.0 and shapes["trained_share"] == 4 / 10
    assert shapes["runs_with"] == {"compression": 0.0, "subagent": 0.0, "retry": 0.0, "timeout": 0.0}
    assert s.runs == {"runs": 2, "requests_moved": 2, "restarts": 0, "statuses": {"finished": 1, "timeout": 1}}


def test_inspect_counts_migrations_restarts_recomputed_prefill_and_flaps(tmp_path):
    """``gyre-hpc inspect --json`` ``flip_effects`` from metrics.h5 alone; each figure here has
    one row that would make it wrong if it were miscounted (e.g. counting empty drains, or a
    relaunch's first flip as a flap)."""
    import json

    from click.testing import CliRunner

    from gyre_hpc.rundir.inspect import inspect
    from gyre_hpc.rundir.metrics import TimelineRow

    run = RunDir.at(tmp_path / "run").make()
    cfg = build_config({"workload": "rl", "run_dir": str(run.root), "train": {"steps": 3}})
    run.config.write_text(cfg.to_yaml())

    def row(t, cell, role, event, step, **kw):
        return TimelineRow(time=float(t), cell=cell, role=role, event=event, step=step, **kw)

    with MetricsWriter(run.metrics) as m:
        m.append([row(0, 1, "ROLLOUT", "start", 1), row(0, 2, "ROLLOUT", "start", 1),
                  # step 1: cell 2 released with 3 requests in flight, cell 1 with none (empty drain row)
                  row(1, 2, "ROLLOUT", "migrate", 1, requests=3, tokens=900, bytes=64),
                  row(1, 2, "TRAIN", "flip_end", 1),
                  row(2, 1, "ROLLOUT", "migrate", 1, requests=0, bytes=0),
                  row(2, 1, "TRAIN", "flip_end", 1),
                  # ... and cell 2 taken back in the same step: a flap
                  row(3, 2, "ROLLOUT", "flip_end", 1),
                  # step 2: cell 1 back for the new batch, released at its tail (the elastic cycle)
                  # with nothing in flight: its drain moved only 2 retained session contexts
                  row(4, 1, "ROLLOUT", "flip_end", 2),
                  row(5, 1, "ROLLOUT", "migrate", 2, requests=2, sessions=2, tokens=300, session_tokens=300, bytes=8),
                  row(5, 1, "TRAIN", "flip_end", 2),
                  # a relaunch redoes step 2: its first flip continues nothing from before
                  row(6, 1, "TRAIN", "start", 2), row(6, 2, "ROLLOUT", "start", 2),
                  row(7, 1, "ROLLOUT", "flip_end", 2)])
        m.append([RunRow(time=1.0, step=1, run_id="a", task_id="t", status="finished", reward=1.0, migrations=3),
                  RunRow(time=5.0, step=2, run_id="b", task_id="t", status="finished", reward=1.0, migrations=0,
                         restarts=2)])
        m.add(StepRow(step=1, time=3.0, wall_s=3.0, recomputed_prefill_tokens=0))
        m.add(StepRow(step=2, time=7.0, wall_s=3.0, recomputed_prefill_tokens=17))
    out = CliRunner().invoke(inspect, [str(run.root), "--json"])
    assert out.exit_code == 0, out.output
    effects = json.loads(out.output)["flip_effects"]
    assert effects == {"flips": 6, "releases": 3, "reclaims": 3, "releases_moving_kv": 2, "requests_moved": 3,
                       "contexts_moved": 2, "kv_moved": 5, "kv_moved_tokens": 1200, "contexts_moved_kv_tokens": 300,
                       "kv_moved_bytes": 72, "flaps": 1, "reversals": 2,
                       "run_requests_moved": 3, "restarts": 2, "recomputed_prefill_tokens": 17}

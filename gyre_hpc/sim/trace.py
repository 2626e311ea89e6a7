"""A real run's own runs as the simulator's batches: trace-driven forecasts.

The environment's time between a run's model calls (tool latency, the harness, the scoring
folded in) is the workload, not the schedule: a forecast of how a policy schedules the very
runs a real fleet ran should replay their times rather than sample a fresh draw, whose luck
(one run twice as long as the next) moves a step by more than the policies differ. Each
run's calls and its environment time per gap come from the run's ``runs`` table (wall time
less the time it waited on model calls, over its calls - 1 gaps, as
``bench.repeats.environment_gaps`` measures it); its group from its run id; tokens per call
are sampled from the workload, as the simulator always does.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from gyre_hpc.rundir.metrics import read_table
from gyre_hpc.sim.batch import Batch, build_batch
from gyre_hpc.sim.workload import Workload, WorkloadError

_GROUP = re.compile(r"-t(\d+)-g\d+$")   # the runtime's run ids, s<step>-t<task>-g<sample> (rl.runs)


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def trace_batches(w: Workload, run_dir: str | Path) -> dict[int, Batch]:
    """Simulated step -> the batch of the real run's step (its first step is step 0). A run's
    advantage group is its task's index in its run id (the runtime's), else its task id (the
    simulator's own run directories)."""
    t = read_table(Path(run_dir) / "metrics.h5", "runs")
    rows: dict[int, list[tuple[str, str, int, float]]] = {}
    for step, rid, task, calls, wall, model in zip(t["step"], t["run_id"], t["task_id"], t["calls"], t["wall_s"],
                                                   t["model_s"]):
        rid = _text(rid)
        m = _GROUP.search(rid)
        group = f"t{int(m.group(1)):09d}" if m else _text(task)
        n = max(int(calls), 1)
        gap = max(float(wall) - float(model), 0.0) / (n - 1) if n > 1 else 0.0
        rows.setdefault(int(step), []).append((group, rid, n, gap))
    if not rows:
        raise WorkloadError(f"{run_dir}: no runs recorded to replay")
    first = min(rows)
    out: dict[int, Batch] = {}
    for real_step, runs in sorted(rows.items()):
        runs.sort()
        step = real_step - first
        rng = np.random.default_rng([w.seed, step])
        calls = np.array([r[2] for r in runs], dtype=np.int64)
        total = int(calls.sum())
        tool = np.repeat([r[3] for r in runs], calls)
        groups = sorted({r[0] for r in runs})
        out[step] = build_batch(w, step, calls, w.run.output_tokens.sample(rng, total),
                                w.run.context_tokens.sample(rng, total), tool, [groups.index(r[0]) for r in runs])
    return out

"""What a benchmark reads from repeated fleets: the steady steps of a run and the spread of
repeats, shared by ``bench e2e`` and its paced regimes (``bench.regime``)."""
from __future__ import annotations

import statistics
from pathlib import Path


def steady(step_s: list[float]) -> list[float]:
    """The steps a policy's steady rate is read from: without the first (imports, the first
    sandbox start, allocator warm-up) and, from three steps on, without the last. Async
    fills and drains a pipeline: its first step also rolls out part of the next, and its last
    has no next step to roll out, so it is short by the work the others did ahead; a middle
    step does both, as every step of a long run does. The same slice is used for every
    policy and for the simulator's steps."""
    if len(step_s) >= 3:
        return step_s[1:-1]
    return step_s[1:] if len(step_s) > 1 else step_s


def spread(values: list[float]) -> dict:
    """Mean, min, max and the relative spread of one policy's repeats."""
    mean = statistics.fmean(values)
    return {"steady_step_s": [round(v, 3) for v in values], "mean": round(mean, 3), "min": round(min(values), 3),
            "max": round(max(values), 3), "spread": round((max(values) - min(values)) / mean, 3) if mean else None}


def ratio_spread(baseline: list[float], elastic: list[float]) -> dict:
    """baseline / elastic step time: of the means, and the lowest and highest over repeat pairs."""
    pairs = [b / e for b, e in zip(baseline, elastic)]
    return {"of_means": round(statistics.fmean(baseline) / statistics.fmean(elastic), 3),
            "min": round(min(pairs), 3), "max": round(max(pairs), 3)}


def environment_gaps(run_dir: str | Path) -> list[float]:
    """Environment time between model calls, per finished run of several calls: its wall time
    less the time it waited on model calls, over its calls - 1 gaps. The simulator puts tool
    time between calls only, so the run's final scoring is folded into those gaps and each
    run's total is kept."""
    from gyre_hpc.rundir.metrics import read_table

    t = read_table(Path(run_dir) / "metrics.h5", "runs")
    ok = (t["calls"] > 1) & (t["status"] == "finished")
    return ((t["wall_s"][ok] - t["model_s"][ok]) / (t["calls"][ok] - 1)).tolist()

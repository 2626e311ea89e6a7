"""A simulated run written as a run directory, in the schema the real runtime writes.

``metrics.h5`` gets the same tables and ``config.yaml`` a run config with the simulated
fleet's plan (so ``gyre-hpc inspect``, the analysis loader and the notebooks read a simulated
run like a real one); ``sim.json`` adds what only a simulation knows exactly: the workload
it ran and the busy split of every cell-second.
"""
from __future__ import annotations

import json
from pathlib import Path

from gyre_hpc.config import RunConfig, build_config
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter
from gyre_hpc.sim.result import SimResult
from gyre_hpc.sim.workload import Workload, to_dict

SIM_SUMMARY = "sim.json"


def write_run(result: SimResult, workload: Workload, root: str | Path) -> RunDir:
    rd = RunDir.at(root)
    rd.root.mkdir(parents=True, exist_ok=True)
    if rd.metrics.exists():
        # A rerun replaces its own output; appending would mix two simulations' rows.
        rd.metrics.unlink()
    summary = result.summary()
    attrs = {"source": "sim", "policy": result.policy, "workload": workload.name,
             "summary_json": json.dumps(summary), "workload_json": json.dumps(to_dict(workload))}
    with MetricsWriter(rd.metrics, attrs=attrs) as mw:
        mw.append(result.timeline)
        mw.append(result.steps)
        mw.append(result.engines)
        mw.append(result.events_log)
        mw.append(result.runs)
    config = run_config(workload, result.policy, rd.root)
    if config is not None:
        rd.config.write_text(config.to_yaml())
    (rd.root / SIM_SUMMARY).write_text(json.dumps(
        {"summary": summary, "step_s": result.step_s, "workload": to_dict(workload)}, indent=2))
    return rd


def run_config(w: Workload, policy: str, root: Path) -> RunConfig | None:
    """The run config a real fleet would need for this simulated one; None for a policy the
    config cannot name (an ad-hoc policy function handed to ``simulate``)."""
    from gyre_hpc.sched.registry import POLICY_NAMES
    if policy not in POLICY_NAMES:
        return None
    f, r = w.fleet, w.run
    split = w.fleet.async_train_cells or 1
    return build_config({
        "name": f"sim-{w.name}-{policy}", "run_dir": str(root), "seed": w.seed,
        "cells": {"count": f.cells, "rollout_only": list(range(f.cells - f.rollout_only, f.cells)),
                  "initial_train": list(range(1, split)) if policy == "async" else None},
        "scheduler": {"policy": policy, "async_train_cells": split, "max_staleness": f.async_max_staleness,
                      "interval_s": w.decision_interval_s},
        "train": {"steps": w.steps},
        "rollout": {"tasks_per_step": r.tasks_per_step, "runs_per_task": r.runs_per_task,
                    "run_timeout_s": r.timeout_s},
    }, source=f"simulated workload {w.name}")

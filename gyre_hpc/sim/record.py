"""A simulated run written as a run directory, in the schema the real runtime writes.

``metrics.h5`` gets the same timeline/steps/engines/events tables (so the analysis loader
and notebooks cannot tell a simulated run from a real one); ``sim.json`` adds what only a
simulation knows exactly: the workload it ran and the busy split of every cell-second.
"""
from __future__ import annotations

import json
from pathlib import Path

from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter
from gyre_hpc.sim.cluster import SimResult
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
    (rd.root / SIM_SUMMARY).write_text(json.dumps(
        {"summary": summary, "step_s": result.step_s, "workload": to_dict(workload)}, indent=2))
    return rd

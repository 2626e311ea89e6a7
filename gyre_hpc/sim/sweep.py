"""Where elastic stops paying off: one knob at a time around a base workload.

The knobs are the ones that decide the trade: how heavy the tail of run lengths is (what
elastic reclaims), how much a switch costs (what it pays), how many cells share the work
(how thin the tail is spread), how expensive training is next to rollout (how much
work the reclaimed cells find), and the async baseline's split (the one knob a fixed split
has; by default it is balanced on the workload's mean work, its best case).
"""
from __future__ import annotations

import dataclasses

from gyre_hpc.sim.compare import compare, scaled
from gyre_hpc.sim.workload import Workload


def sweep_points(base: Workload) -> list[tuple[str, object, Workload]]:
    f, r, t = base.fleet, base.run, base.train
    points: list[tuple[str, object, Workload]] = []
    for sigma in (0.2, 0.5, 0.8, 1.2):
        points.append(("tail_sigma", sigma, scaled(base, **{"run.calls": dataclasses.replace(r.calls, sigma=sigma)})))
    for k in (0.0, 1.0, 10.0, 60.0):
        points.append(("switch_cost_x", k, scaled(base, **{"fleet.rollout_to_train_s": f.rollout_to_train_s * k,
                                                         "fleet.train_to_rollout_s": f.train_to_rollout_s * k})))
    for cells in (8, 16, 64, 256):
        points.append(("cells", cells, scaled(base, **{"fleet.cells": cells})))
    for share in (0.125, 0.25, 0.5, 0.75):
        points.append(("async_train_share", share,
                       scaled(base, **{"fleet.async_train_cells": max(1, min(f.cells - 1, round(f.cells * share)))})))
    for k in (0.1, 1.0, 10.0):
        points.append(("train_cost_x", k, scaled(base, **{"train.tokens_per_s": t.tokens_per_s / k})))
    return points


def sweep(base: Workload) -> dict:
    rows = []
    for knob, value, w in sweep_points(base):
        rep = compare(w)
        hours = {k: v["total_h"] for k, v in rep["policies"].items()}
        seconds = {k: v["total_s"] for k, v in rep["policies"].items()}
        rows.append({"knob": knob, "value": value, **{f"{k}_h": h for k, h in hours.items()},
                     **{f"{k}_s": x for k, x in seconds.items()}, **rep["speedup"],
                     "async_train_cells": rep["async_train_cells"], "sim_wall_s": rep["sim_wall_s"]})
    return {"base": base.name, "steps": base.steps, "cells": base.fleet.cells, "rows": rows,
            "elastic_slower_than": {
                b: [f"{r['knob']}={r['value']}" for r in rows if r[f"elastic_over_{b}"] < 1.0]
                for b in ("async", "colocate")}}

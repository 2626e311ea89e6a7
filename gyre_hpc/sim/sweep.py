"""Where elastic wins and where it loses: one knob at a time around a base workload.

The knobs are the ones that decide the trade: how expensive training is next to rollout
(how much work the released engines find), how heavy the tail of run lengths is (what
elastic reclaims), how many cells share the work (how thin the tail is spread), and what
a switch costs (what it pays). Async is run at the base's typical split (as a share of the
cells) and at its tuned split (the fastest by simulation, ``compare.tuned_async``), so
every row says how elastic fares against both a configured and a best-case fixed split.
"""
from __future__ import annotations

import dataclasses

from gyre_hpc.sim.compare import compare, scaled
from gyre_hpc.sim.workload import Workload


def with_cells(w: Workload, cells: int) -> Workload:
    """The same workload on ``cells`` cells, the async split kept as the same share (never
    below the cells that hold the training state)."""
    share = w.fleet.async_train_cells / w.fleet.cells
    k = max(1, w.core_cells, min(cells - 1, round(cells * share)))
    return scaled(w, **{"fleet.cells": cells, "fleet.async_train_cells": k})


def sweep_points(base: Workload) -> list[tuple[str, object, Workload]]:
    f, r, t = base.fleet, base.run, base.train
    points: list[tuple[str, object, Workload]] = []
    for k in (0.25, 0.5, 1.0, 2.0, 4.0):
        # training cost over its base: 2 = every token takes twice as long to train
        points.append(("train_cost_x", k, scaled(base, **{"train.tokens_per_s": t.tokens_per_s / k})))
    for sigma in (0.2, 0.5, 0.8, 1.1):
        points.append(("tail_sigma", sigma, scaled(base, **{"run.calls": dataclasses.replace(r.calls, sigma=sigma)})))
    for cells in sorted({max(4, f.cells // 4), max(4, f.cells // 2), f.cells, f.cells * 2}):
        if cells - 1 - f.rollout_only > base.core_cells:   # room for an engine beside the training state
            points.append(("cells", cells, with_cells(base, cells)))
    for k in (0.0, 10.0, 60.0):
        points.append(("switch_cost_x", k, scaled(base, **{"fleet.rollout_to_train_s": f.rollout_to_train_s * k,
                                                         "fleet.train_to_rollout_s": f.train_to_rollout_s * k})))
    return points


def sweep(base: Workload) -> dict:
    rows = []
    for knob, value, w in sweep_points(base):
        rep = compare(w, tune_async=True)
        tuned = rep["async_tuned"]
        hours = {k: v["total_h"] for k, v in rep["policies"].items()}
        row = {"knob": knob, "value": value, **{f"{k}_h": h for k, h in hours.items()},
               **{f"{k}_s": v["total_s"] for k, v in rep["policies"].items()},
               "async_tuned_h": tuned["total_h"], "async_tuned_train_cells": tuned["train_cells"],
               "async_train_cells": rep["async_train_cells"], **rep["speedup"],
               "elastic_over_async_tuned": tuned["elastic_over_async_tuned"],
               "elastic_over_bound": rep["lower_bound"]["over_bound"]["elastic"],
               "sim_wall_s": rep["sim_wall_s"]}
        rows.append(row)
    versus = {"async": "elastic_over_async", "async_tuned": "elastic_over_async_tuned",
              "colocate": "elastic_over_colocate"}
    return {"base": base.name, "steps": base.steps, "cells": base.fleet.cells,
            "async_train_cells": base.fleet.async_train_cells, "rows": rows,
            "elastic_slower_than": {b: [f"{r['knob']}={r['value']}" for r in rows if r[key] < 1.0]
                                    for b, key in versus.items()}}

"""A regime's dimensionless shape: the ratios a small emulated testbed must reproduce to be
in the same regime as a cluster-scale preset (design.md section 7, issue 25's paper-local).

Four ratios decide how the policies compare, whatever the scale: how much of a colocate
step training takes (what releasing engines can win), how much longer the slowest run of a
batch is than the median one (how long the tail idles engines), what a switch costs against
a step, and how full the engines' KV is with the runs a colocate step puts on each.
"""
from __future__ import annotations

import statistics

from gyre_hpc.sim.batch import sample_batch
from gyre_hpc.sim.result import SimResult
from gyre_hpc.sim.workload import Workload


def regime_shape(w: Workload, colocate: SimResult) -> dict:
    """The four ratios of ``w``, read off its colocate simulation and its sampled batches."""
    steps = max(len(colocate.step_s), 1)
    mean_step = sum(colocate.step_s) / steps
    train_s = (colocate.tokens_trained / steps) / w.train.rate(w.fleet.cells)
    tails, contexts = [], []
    for s in range(w.steps):
        b = sample_batch(w, s)
        tails.append(max(b.critical_s) / statistics.median(b.critical_s))
        contexts += [sum(c) / len(c) for c in b.ctx]
    engines = w.fleet.cells - w.core_cells
    cap = w.engine.kv_capacity_tokens()
    runs_per_engine = w.run.runs_per_step / max(engines, 1)
    return {
        "train_share_of_colocate_step": round(train_s / mean_step, 4) if mean_step else None,
        "slowest_over_median_run": round(statistics.median(tails), 3),
        "switch_over_step": round(w.fleet.rollout_to_train_s / mean_step, 5) if mean_step else None,
        "runs_per_engine": round(runs_per_engine, 2),
        "runs_per_engine_over_kv_contexts": (round(runs_per_engine / (cap / statistics.fmean(contexts)), 4)
                                             if cap else None),
    }

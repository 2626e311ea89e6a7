"""How far the headline moves when the priors do: every prior at each end of its range, on
several seeds, refitted to colocate each time, every policy and ratio reported as a band.

A variant is (one prior at one end, or none) x a seed. In each, the fitted figure is refit
so colocate takes the reference hours (``calibrate.fit``, not strict: a variant whose fit
leaves its prior is kept and flagged), then elastic on-policy, colocate, async at the
paper's split (refused, with the figure, where the split cannot hold the training state),
the tuned async split, and elastic at staleness 1 holding the tuned split as its floor.
Variants run ``steps`` RL steps each (the steps are independent draws) and hours are
scaled to the preset's step count; variants run in parallel processes.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
from concurrent.futures import ProcessPoolExecutor

from gyre_hpc.sim.calibrate import field_value, fit
from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.compare import scaled, tuned_async
from gyre_hpc.sim.priors import PRIORS, REFERENCE_COLOCATE_H, Prior
from gyre_hpc.sim.workload import Workload, WorkloadError


@dataclasses.dataclass(frozen=True)
class Variant:
    prior: str          # the prior moved ("" = none: the base)
    value: float
    seed: int


def variants(base: Workload, priors: tuple[Prior, ...], seeds: tuple[int, ...]) -> list[Variant]:
    out = [Variant("", 0.0, s) for s in seeds]
    for p in priors:
        for v in (p.low, p.high):
            out += [Variant(p.path, v, s) for s in seeds]
    return out


def run_variant(base: Workload, fitted: Prior, target_h: float, v: Variant) -> dict:
    """One variant's hours (scaled to the base's step count by the caller) and ratios."""
    t0 = time.perf_counter()
    w = dataclasses.replace(base, seed=v.seed)
    if v.prior:
        w = scaled(w, **{v.prior: v.value})
    f = fit(w, fitted, target_h, strict=False)
    w = scaled(w, **{fitted.path: f.value})
    row: dict = {"prior": v.prior or "base", "value": v.value, "seed": v.seed, "fitted": round(f.value, 1),
                 "fit_inside_prior": f.inside_prior, "fit_error": round(f.error, 4)}
    hours = {"colocate": f.hours}   # the fit simulated colocate at f.value, inside its prior or at its end
    hours["elastic_s0"] = simulate(w, policy_for(w, "elastic"), "elastic").total_h
    try:
        hours["async_paper_split"] = simulate(w, policy_for(w, "async"), "async").total_h
    except WorkloadError as exc:
        row["async_paper_split_refused"] = str(exc)
    tuned = tuned_async(w, prune=True)
    hours["async_tuned"] = tuned["total_h"]
    row["tuned_train_cells"] = tuned["train_cells"]
    s1 = policy_for(w, "elastic", max_staleness=1, train_floor_cells=tuned["train_cells"])
    hours["elastic_s1"] = simulate(w, s1, "elastic").total_h
    row["hours"] = hours
    row["ratios"] = ratios(hours)
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    return row


def ratios(h: dict[str, float]) -> dict[str, float]:
    out = {"elastic_s0_over_colocate": h["colocate"] / h["elastic_s0"],
           "elastic_s0_over_async_tuned": h["async_tuned"] / h["elastic_s0"],
           "elastic_s1_over_async_tuned": h["async_tuned"] / h["elastic_s1"]}
    if "async_paper_split" in h:
        out["elastic_s0_over_async_paper_split"] = h["async_paper_split"] / h["elastic_s0"]
    return out


def sensitivity(base: Workload, steps: int = 8, seeds: tuple[int, ...] = (0, 1, 2), workers: int = 0) -> dict:
    """The band of every policy's hours and of each ratio across the priors of ``base``'s preset."""
    if base.name not in PRIORS:
        raise WorkloadError(f"--sensitivity: preset {base.name!r} has no documented priors; "
                            f"presets with priors: {', '.join(sorted(PRIORS))}")
    fitted, priors = PRIORS[base.name]
    short = dataclasses.replace(base, steps=min(steps, base.steps))
    scale = base.steps / short.steps
    reference = REFERENCE_COLOCATE_H.get(base.name)
    if reference is None:
        reference = simulate(short, policy_for(short, "colocate"), "colocate").total_h * scale
    target = reference / scale
    every = variants(short, priors, seeds)
    # A prior whose end is the base's own value gives the base's variant: simulated once.
    todo = [v for v in every if not v.prior or field_value(short, v.prior) != v.value]
    t0 = time.perf_counter()
    workers = workers or min(len(todo), os.cpu_count() or 1)
    args = ([short] * len(todo), [fitted] * len(todo), [target] * len(todo), todo)
    if workers == 1:
        done = list(map(run_variant, *args))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            done = list(pool.map(run_variant, *args))
    by_variant = dict(zip(todo, done))
    rows = [by_variant[v] if v in by_variant else
            {**copy.deepcopy(by_variant[Variant("", 0.0, v.seed)]), "prior": v.prior, "value": v.value,
             "same_as_base": True, "wall_s": 0.0}
            for v in every]
    for r in rows:
        r["hours"] = {k: round(v * scale, 3) for k, v in r["hours"].items()}
        r["ratios"] = {k: round(v, 3) for k, v in r["ratios"].items()}
    bands = {}
    for key in ("hours", "ratios"):
        names = sorted({k for r in rows for k in r[key]})
        bands[key] = {k: {"min": min(r[key][k] for r in rows if k in r[key]),
                          "max": max(r[key][k] for r in rows if k in r[key]),
                          "variants": sum(k in r[key] for r in rows)} for k in names}
    worst = {k: min(rows, key=lambda r: r["ratios"][k]) for k in ("elastic_s0_over_colocate",
                                                                   "elastic_s1_over_async_tuned")}
    return {
        "preset": base.name, "steps_simulated": short.steps, "hours_scaled_to_steps": base.steps,
        "seeds": list(seeds), "variants": len(rows), "fitted": fitted.path,
        "fit_target_colocate_h": round(reference, 3),
        "priors": {p.path: {"low": p.low, "high": p.high, "why": p.why} for p in priors},
        "bands": bands,
        "worst": {k: {"ratio": r["ratios"][k], "prior": r["prior"], "value": r["value"], "seed": r["seed"]}
                  for k, r in worst.items()},
        "dominance": {"elastic_s0_never_slower_than_colocate":
                      all(r["ratios"]["elastic_s0_over_colocate"] >= 1.0 for r in rows),
                      "elastic_s1_never_slower_than_tuned_async":
                      all(r["ratios"]["elastic_s1_over_async_tuned"] >= 1.0 for r in rows)},
        "fits_outside_prior": [f"{r['prior']}={r['value']} seed {r['seed']}" for r in rows if not r["fit_inside_prior"]],
        "async_paper_split_refused": sorted({f"{r['prior']}={r['value']}" for r in rows
                                             if "async_paper_split_refused" in r}),
        "rows": rows, "wall_s": round(time.perf_counter() - t0, 1), "workers": workers,
    }

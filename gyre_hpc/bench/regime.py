"""``gyre-hpc bench e2e --regime paper-local``: the policies on paced cells shaped like the paper.

The cells of ``examples/paper-local.yaml`` are paced by the device model (DURATIONS EMULATED,
design.md section 7), so each cell has capacity of its own although all of them share this
machine's cores. The variants, each on the same seeds and interleaved so a neighbour's burst
lands on all alike:

- ``elastic``: on-policy (staleness 0);
- ``colocate``: every cell rolls out, then every cell trains;
- ``async-K``: the static split the simulator finds fastest for this regime (K training
  cells, staleness 1), and its neighbours K-1 and K+1 once each, so "best" is measured;
- ``elastic-s1``: elastic at staleness 1 holding the same K cells as a training floor.

Beside the times: every step's reward (the paper compares at matching scores), the overrun
share of the paced cells (above ``MAX_OVERRUN`` the emulation is not valid: the bench says
so and exits non-zero), and the simulator's forecast of each variant on the same device
model with the run shape measured from the elastic run, on that run's own runs (their
environment times replayed, ``sim.trace``: every variant ran the same seeded runs).
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

import click

REGIMES = {"paper-local": Path(__file__).resolve().parents[2] / "examples" / "paper-local.yaml"}
MAX_OVERRUN = 0.05
TARGETS = {"elastic_over_colocate": 1.15, "elastic_s1_over_best_static": 1.0, "forecast_error": 0.10,
           "overrun_share": MAX_OVERRUN}


@dataclass(frozen=True)
class Variant:
    """One configuration the regime runs: a name in the JSON and the scheduler section it sets."""
    name: str
    scheduler: dict
    repeated: bool = True


def variants(best_split: int, cells: int) -> list[Variant]:
    """The variants of one regime around the simulator's best static split (a pure function:
    the neighbours stay inside 1..cells-1)."""
    out = [Variant("elastic", {"policy": "elastic", "max_staleness": 0}),
           Variant("colocate", {"policy": "colocate"}),
           Variant(f"async-{best_split}", {"policy": "async", "async_train_cells": best_split, "max_staleness": 1})]
    out += [Variant(f"async-{k}", {"policy": "async", "async_train_cells": k, "max_staleness": 1}, repeated=False)
            for k in (best_split - 1, best_split + 1) if 1 <= k <= cells - 1]
    out.append(Variant("elastic-s1", {"policy": "elastic", "max_staleness": 1,
                                      "elastic": {"max_staleness": 1, "train_floor_cells": best_split}}))
    return out


def regime_config(regime: str, run_dir: Path, variant: Variant, steps: int, seed: int) -> dict:
    """The run config of one variant: the regime's file with the variant's scheduler."""
    from gyre_hpc.config import load_yaml

    path = REGIMES[regime]
    if not path.is_file():
        raise click.ClickException(f"--regime {regime} reads {path}, which is missing (run from a checkout)")
    cfg = load_yaml(path.read_text())
    cfg.update({"name": f"{regime}-{variant.name}", "run_dir": str(run_dir), "seed": seed})
    cfg["scheduler"] = {**cfg.get("scheduler", {}), **variant.scheduler}
    cfg["train"] = {**cfg.get("train", {}), "steps": steps}
    return cfg


def sim_workload(regime: str, steps: int, measured_from: str | None = None):
    """The simulator's workload of the regime: its preset (the same device model as the paced
    cells), with the run shape and switch costs measured from a run when one is given. Rates
    are never measured from a paced run: they are the device model's by construction."""
    from gyre_hpc.sim.workload import override, preset

    w = dataclasses.replace(preset(regime), steps=steps)
    if measured_from is None:
        return w, {}
    from gyre_hpc.sim.measure import measure

    m = measure(measured_from)
    keep = {"run": m.overrides.get("run", {}), "fleet": {k: v for k, v in m.overrides.get("fleet", {}).items()
                                                         if k in ("rollout_to_train_s", "in_place_join_s",
                                                                  "train_to_rollout_s")}}
    keep["run"] = {k: v for k, v in keep["run"].items()
                   if k in ("calls", "output_tokens", "context_tokens", "trained_per_token")}
    tool = environment_s(measured_from)
    if tool is not None:
        keep["run"]["tool_s"] = tool
    return override(w, keep), {"measured": keep, "not_measured": m.not_measured}


def environment_s(run_dir: str) -> dict | None:
    """The environment's time between calls as the run measured it (bench.repeats.environment_gaps)."""
    from gyre_hpc.bench.repeats import environment_gaps
    from gyre_hpc.sim.measure import lognormal_fit

    gaps = environment_gaps(run_dir)
    return lognormal_fit(gaps) if len(gaps) >= 2 else None


def best_split(w) -> dict:
    from gyre_hpc.sim.compare import tuned_async

    return tuned_async(w)


def simulate_scheduler(w, scheduler: dict, batches=None):
    """The simulator's run of ``w`` under a config's ``scheduler`` section (policy, async
    split and staleness, elastic parameters): the same choices the fleet was given; on
    ``batches`` when given (a real run's own runs, ``sim.trace``)."""
    from gyre_hpc.sim.cluster import policy_for, simulate
    from gyre_hpc.sim.workload import PolicyParams

    policy = scheduler["policy"]
    if policy == "async":
        w = dataclasses.replace(w, fleet=dataclasses.replace(w.fleet, async_train_cells=scheduler["async_train_cells"],
                                                             async_max_staleness=scheduler["max_staleness"]))
    elif policy == "elastic":
        params = dataclasses.replace(w.policy.elastic, **scheduler.get("elastic", {}))
        w = dataclasses.replace(w, policy=PolicyParams(elastic=params))
    return w, simulate(w, policy_for(w, policy), policy, batches)


def forecast(w, names: list[Variant], batches=None) -> dict[str, float]:
    """Mean steady step (bench.repeats.steady) the simulator predicts for each variant, on
    ``batches`` when given (every variant ran the same seeded runs, so the elastic run's trace
    is each one's workload)."""
    from gyre_hpc.bench.repeats import steady

    return {v.name: round(statistics.fmean(steady(list(simulate_scheduler(w, v.scheduler, batches)[1].step_s))), 3)
            for v in names}


def simulated_twin(run_dir: str | Path, out: str | Path, regime: str = "paper-local") -> Path:
    """The simulator's run of a paced run's own regime and scheduler, written as a run
    directory beside it (the timeline notebook draws both Gantts): the device model the cells
    were paced by, the run shape the run measured."""
    from gyre_hpc.config import load_config
    from gyre_hpc.sim.record import write_run

    cfg = load_config(Path(run_dir) / "config.yaml")
    if cfg.cells.device != "paced":
        raise click.ClickException(f"{run_dir}: cells.device={cfg.cells.device!r}, not a paced run")
    from gyre_hpc.sim.trace import trace_batches

    w, _ = sim_workload(regime, cfg.train.steps, measured_from=str(run_dir))
    w, result = simulate_scheduler(w, cfg.scheduler.model_dump(), trace_batches(w, run_dir))
    write_run(result, w, out)
    return Path(out)


def overrun(run_dir: str) -> dict | None:
    from gyre_hpc.rundir.inspect import summarize

    return summarize(run_dir).pace


def report(regime: str, names: list[Variant], summaries: dict[str, list[dict]], sim: dict,
           paces: dict[str, list[dict | None]]) -> dict:
    """The regime's JSON: per variant its repeats, rewards and overruns; the ratios the issue
    asks for against the best measured static split; the forecast's error per variant."""
    from gyre_hpc.bench.repeats import ratio_spread, spread

    steady_of = {v: [s["steady_step_s"] for s in ss] for v, ss in summaries.items()}
    statics = {v: statistics.fmean(x) for v, x in steady_of.items() if v.startswith("async-")}
    best_static = min(statics, key=statics.get) if statics else None
    shares = [p["overrun_share"] for ps in paces.values() for p in ps if p]
    worst = max(shares) if shares else None
    # Targets are judged on the unrounded figures; the report rounds them for reading only (a
    # 0.9996x once printed 1.0 and counted as met).
    exact_errors = {v: abs(sim["predicted_step_s"][v] - statistics.fmean(x)) / statistics.fmean(x)
                    for v, x in steady_of.items()}
    errors = {v: round(e, 3) for v, e in exact_errors.items()}

    def of_means(baseline: str, policy: str) -> float:
        return statistics.fmean(steady_of[baseline]) / statistics.fmean(steady_of[policy])
    speedup = {"elastic_over_colocate": ratio_spread(steady_of["colocate"], steady_of["elastic"])}
    if best_static:
        speedup["elastic_over_best_static"] = ratio_spread(steady_of[best_static], steady_of["elastic"])
        speedup["elastic_s1_over_best_static"] = ratio_spread(steady_of[best_static], steady_of["elastic-s1"])
    return {
        "regime": regime, "durations": "EMULATED (paced cells: cells.device=paced, gyre_hpc/devices)",
        "variants": {v: {"scheduler": next(n.scheduler for n in names if n.name == v),
                         "repeats": spread(steady_of[v]),
                         "reward_mean_per_step": [s["reward_mean"] for s in ss],
                         "flips": [s["flips"] for s in ss],
                         "overrun_share": [p["overrun_share"] if p else None for p in paces[v]]}
                     for v, ss in summaries.items()},
        "best_static": best_static,
        "speedup": speedup,
        "simulator": {**sim, "error": errors, "max_error": max(errors.values()) if errors else None},
        "overrun_share_max": worst,
        "valid": worst is not None and worst <= MAX_OVERRUN,
        "targets": TARGETS,
        "met": {"elastic_over_colocate": of_means("colocate", "elastic") >= TARGETS["elastic_over_colocate"],
                "elastic_s1_over_best_static": bool(best_static)
                and of_means(best_static, "elastic-s1") >= TARGETS["elastic_s1_over_best_static"],
                "forecast_within_10pct": bool(exact_errors) and max(exact_errors.values()) <= TARGETS["forecast_error"],
                "overrun_share": worst is not None and worst <= MAX_OVERRUN},
    }

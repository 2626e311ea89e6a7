"""``gyre-hpc bench e2e``: the three policies on one real RL workload, then the simulator's forecast.

Each policy (elastic, colocate, async) runs the real fleet (controller, engines over MPI,
harness runs, trees, streaming training) on the same workload with the same seeds:
``--workload long`` (the default: the long-horizon suite of ``make run``, tens of calls per
run, sub-agents, a wall clock) or ``--workload easy-3turn`` (three model calls per run with
``rollout.tool_latency_s``, a lognormal environment wait after each tool call, so on a small
machine runs spend most of their time in tools and idle engines exist to be reclaimed). Launcher: the
local Slurm cluster when it is up (one ``srun`` het step per policy over its virtual nodes),
else ``mpiexec`` on this machine (``--launcher``; the JSON says which). Per policy: wall time per step,
busy fractions (``rundir.load.time_fractions``), flips and requests moved mid-decode; elastic's speedups
are ratios of totals measured in this same invocation.

Then the simulator (``gyre_hpc.sim``) is given the workload's measured parameters
(``sim.measure`` on each policy's run directory, plus the optimizer and weight-sync times the
controller measured) and predicts each policy's mean step time; the JSON lists prediction,
measurement and the relative error (the target is within 15%).

The module is also the rank program (``python -m gyre_hpc.bench.e2e --ranks RUN_DIR OUT``).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click

from gyre_hpc.report import emit
from gyre_hpc.bench.repeats import environment_gaps, ratio_spread, spread, steady

POLICIES = ("elastic", "colocate", "async")


WORKLOADS = ("easy-3turn", "long")
# ``long``: the workload of ``make run`` itself, read from the file it runs (one place for it).
LONG_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "local.yaml"


def workload_config(run_dir: Path, policy: str, steps: int, seed: int, workload: str = "easy-3turn") -> dict:
    """The run config of one policy's fleet. ``easy-3turn``: three calls per run, a 1.5 s median
    tool wait, a ``small`` model whose training is a real share of the step. ``long``: the
    long-horizon suite exactly as ``examples/local.yaml`` runs it (warm start, wall clock,
    heavy-tailed tool waits), the policy frozen (``lr`` 1e-7) so every step is the same workload."""
    if workload == "long":
        from gyre_hpc.config import load_yaml

        if not LONG_CONFIG.is_file():
            raise click.ClickException(f"--workload long reads {LONG_CONFIG}, which is missing (run from a checkout)")
        cfg = load_yaml(LONG_CONFIG.read_text())
        cfg.update({"name": f"e2e-{policy}", "run_dir": str(run_dir), "launcher": "local", "seed": seed})
        cfg["scheduler"] = {**cfg.get("scheduler", {}), "policy": policy, "async_train_cells": 1, "interval_s": 0.25}
        cfg["train"] = {**cfg.get("train", {}), "steps": steps, "lr": 1e-7}
        return cfg
    if workload != "easy-3turn":
        raise click.BadParameter(f"{workload!r}: workloads are {', '.join(WORKLOADS)}", param_hint="--workload")
    return {
        "name": f"e2e-{policy}", "run_dir": str(run_dir), "launcher": "local", "workload": "rl", "seed": seed,
        "cells": {"count": 3, "ranks_per_cell": 1, "core": 0},
        "scheduler": {"policy": policy, "async_train_cells": 1, "interval_s": 0.25},
        "model": {"preset": "small"},
        # Three model calls per run with a lognormal tool wait (median 1.5 s) between them.
        "rollout": {"tasks": "easy-3turn", "runs_per_task": 8, "tasks_per_step": 2, "max_new_tokens": 32,
                    "tool_latency_s": 1.5, "tool_latency_sigma": 0.6},
        # A small learning rate keeps the policy (and so the workload) steady over the steps.
        "train": {"steps": steps, "lr": 1e-4, "micro_batch_tokens": 1024, "row_tokens": 1024},
    }


def workload_summary(workload: str, steps: int, seed: int) -> dict:
    """What the JSON says the policies ran, read from the config they ran."""
    from gyre_hpc.config import build_config

    cfg = build_config(workload_config(Path("e2e"), "elastic", steps, seed, workload))
    r = cfg.rollout
    return {"tasks": r.tasks, "tool_latency_s": r.tool_latency_s, "tool_latency_sigma": r.tool_latency_sigma,
            "run_timeout_s": r.run_timeout_s, "cells": cfg.cells.count,
            "runs_per_step": r.runs_per_task * r.tasks_per_step, "steps": steps, "seed": seed,
            "lr": cfg.train.lr, "warm_start": cfg.warmstart.enabled}


def resolve_launcher(choice: str) -> tuple[str, list[str] | None]:
    """``auto``: the local Slurm cluster when it is up (>= 3 usable nodes), else mpiexec here."""
    if choice == "local":
        return "local", None
    from gyre_hpc.bench.switch import usable_slurm_nodes
    try:
        return "slurm", usable_slurm_nodes()
    except (click.ClickException, OSError) as exc:
        if choice == "slurm":
            raise click.ClickException(f"--launcher slurm: {getattr(exc, 'message', exc)}") from None
        return "local", None


def run_policy(root: Path, policy: str, steps: int, seed: int, timeout_s: float,
               launcher: str = "local", nodes: list[str] | None = None, name: str | None = None,
               workload: str = "easy-3turn") -> dict:
    name = name or policy
    return run_config(workload_config(root / name, policy, steps, seed, workload), timeout_s, launcher, nodes)


def run_config(config: dict, timeout_s: float, launcher: str = "local", nodes: list[str] | None = None) -> dict:
    """One fleet of ``config`` through the launcher, timed; its result and run directory."""
    from gyre_hpc.config import build_config
    from gyre_hpc.jobs.launchers import LocalLauncher, SlurmLauncher
    from gyre_hpc.jobs.plan import local_plan, plan_for_nodes
    from gyre_hpc.jobs.preflight import prepare_workload_config
    from gyre_hpc.rundir.layout import RunDir

    policy = config.get("name", "fleet")
    cfg = build_config({**config, "launcher": launcher})
    # The warm start (``long``) is built once, before any timing, and found in its cache after.
    cfg = prepare_workload_config(cfg, build=True, log=lambda m: print(m, file=sys.stderr))
    run = RunDir.at(cfg.run_dir).make()
    run.config.write_text(cfg.to_yaml())
    out = run.logs / "result.json"
    argv = [sys.executable, "-m", "gyre_hpc.bench.e2e", "--ranks", str(run.root), str(out)]
    if launcher == "slurm":
        # Cells that name their memory share nodes (one packed step, jobs.plan.FleetPlan.packed);
        # otherwise each takes nodes of its own.
        plan = local_plan(cfg)
        plan = plan if plan.packed else plan_for_nodes(cfg, nodes)
        runner = SlurmLauncher(mpi=cfg.slurm.mpi)
    else:
        plan, runner = local_plan(cfg), LocalLauncher()
    t0 = time.perf_counter()
    handle = runner.launch(plan, argv, log_path=run.logs / "fleet.log", cwd=run.root)
    try:
        rc = handle.wait(timeout_s)
    except Exception:
        handle.kill()
        raise click.ClickException(f"{policy}: the fleet did not finish in {timeout_s:.0f} s; "
                                   f"see {run.logs / 'fleet.log'}") from None
    wall = time.perf_counter() - t0
    if rc != 0 or not out.exists():
        raise click.ClickException(f"{policy}: the fleet exited {rc}; see {run.logs / 'fleet.log'}")
    return {"run_dir": str(run.root), "launch_wall_s": wall, "result": json.loads(out.read_text())}


def slowest_run_share(runs: dict, steps: dict) -> float | None:
    """Mean over the steady steps (``steady``) of (the step's slowest run) / (step wall time): near 1,
    the step is the slowest run's own time (its tool waits and calls) and no schedule of the
    cells can shorten it much; what a policy can win is the rest."""
    shares = []
    kept = set(steady([int(x) for x in steps["step"]]))
    for step, wall in zip(steps["step"], steps["wall_s"]):
        mine = runs["wall_s"][runs["step"] == step]
        if int(step) in kept and len(mine) and wall > 0:
            shares.append(float(max(mine)) / float(wall))
    return round(statistics.fmean(shares), 3) if shares else None


def summarize(policy: str, got: dict) -> dict:
    from gyre_hpc.rundir.load import open_run, time_fractions
    from gyre_hpc.rundir.metrics import read_table

    res = got["result"]
    step_s = [s["wall_s"] for s in res["steps"]]
    fractions = time_fractions(open_run(got["run_dir"]))
    metrics = Path(got["run_dir"]) / "metrics.h5"
    share = slowest_run_share(read_table(metrics, "runs"), read_table(metrics, "steps"))
    return {
        "step_s": [round(x, 3) for x in step_s],
        "mean_step_s": round(statistics.fmean(step_s), 3),
        # The steady figure (``steady``: no warm-up, no pipeline fill or drain) is what the
        # policies differ in.
        "steady_step_s": round(statistics.fmean(steady(step_s)), 3),
        "total_s": round(sum(step_s), 3),
        "busy": {k: round(v, 3) for k, v in fractions.items()},
        "slowest_run_share": share,
        "flips": len(res["flips"]),
        "requests_moved": res["totals"]["migrations"],
        "restarts": sum(s["restarts"] for s in res["steps"]),
        "recomputed_prefill_tokens": res["totals"].get("recomputed_prefill_tokens", 0),
        "reward_mean": [round(s["reward_mean"], 3) for s in res["steps"]],
        "optimizer_s": round(statistics.fmean(s["optimizer_s"] for s in res["steps"]), 4),
        "weight_sync_s": round(statistics.fmean(s["weight_sync_s"] for s in res["steps"]), 4),
    }


def saturation(load_before: float, load_after: float) -> dict:
    """What bounds the figures on this machine: the CPU when the run queue exceeds the cores."""
    cores = os.cpu_count() or 1
    load = max(load_before, load_after)
    return {"cores": cores, "load_average_1min": [round(load_before, 2), round(load_after, 2)],
            "saturated": "cpu" if load > cores else None,
            "note": (f"load {load:.1f} on {cores} cores: every rank (controller, engines, replicas, tool "
                     f"processes) shares them, so step times measure CPU contention as much as the schedule"
                     if load > cores else "")}


TARGETS = {"elastic_over_colocate": 1.15, "elastic_over_async": 1.0}


def limits(all_summaries: dict[str, list[dict]], resources: dict) -> dict:
    """What bounds the speedups here: the saturated resource, and how much of a step is the
    slowest run itself (a share near 1 leaves a schedule little to win)."""
    share = {p: round(statistics.fmean(x for x in (s["slowest_run_share"] for s in ss) if x is not None), 3)
             for p, ss in all_summaries.items() if any(s["slowest_run_share"] is not None for s in ss)}
    notes = []
    if resources.get("saturated"):
        notes.append(f"{resources['saturated']} saturated ({resources['note']}): a released engine's cell trains on "
                     f"the same cores the engines and tools use, so it moves compute instead of adding it")
    on_policy = {p: v for p, v in share.items() if p != "async"}
    if on_policy and min(on_policy.values()) >= 0.8:
        notes.append(f"the slowest run is {min(on_policy.values()):.0%}-{max(on_policy.values()):.0%} of an on-policy "
                     f"step: its own tool waits and calls, which no cell schedule of one step shortens")
    if share.get("async", 0) > 1:
        notes.append(f"async's slowest run is {share['async']:.0%} of its step: it overlaps the next step's runs "
                     f"(continuous admission, staleness 1), which an on-policy schedule (elastic) may not do")
    return {"targets": TARGETS, "saturated": resources.get("saturated"), "slowest_run_share": share,
            "note": "; ".join(notes)}


def simulate(reps: dict[str, list[dict]], all_summaries: dict[str, list[dict]], interval_s: float) -> dict:
    """The simulator on the measured workload, every policy on the same sampled runs. The
    workload is measured on each policy's first repeat, tool times on every repeat; each
    forecast is set against the mean of its policy's repeats (what a forecast predicts is the
    expected step, not one draw), with the error against each repeat beside it."""
    runs = {p: r[0] for p, r in reps.items()}
    summaries = {p: s[0] for p, s in all_summaries.items()}

    try:
        from gyre_hpc.sim.cluster import policy_for, simulate as sim_run
        from gyre_hpc.sim.measure import lognormal_fit, measure
        from gyre_hpc.sim.workload import override, preset
    except ImportError as exc:   # the simulator's measurement is another part's module
        return {"error": f"simulator unavailable: {exc}"}
    measured = {name: measure(r["run_dir"]) for name, r in runs.items()}
    overrides = json.loads(json.dumps(measured["elastic"].overrides))
    # Switch costs: elastic may flip one way only; every run's flips measure the same machinery.
    for key in ("rollout_to_train_s", "train_to_rollout_s"):
        seen = [m.overrides.get("fleet", {}).get(key) for m in measured.values()]
        seen = [x for x in seen if x is not None]
        if seen:
            overrides.setdefault("fleet", {})[key] = statistics.median(seen)
    # What sim.measure cannot see in metrics.h5 but the controller measured directly.
    overrides.setdefault("train", {}).update(
        optimizer_step_s=statistics.fmean(s["optimizer_s"] for s in summaries.values()),
        weight_sync_s=statistics.fmean(s["weight_sync_s"] for s in summaries.values()))
    # The runtime's async rolls the next step out while this one trains (staleness 1).
    overrides.setdefault("fleet", {}).update(async_train_cells=1, async_max_staleness=1)
    overrides["decision_interval_s"] = interval_s
    # Environment time measured directly: a run's wall time minus the time it waited on model
    # calls (queueing and decoding included), per call, over every policy's runs.
    tool = [x for rs in reps.values() for r in rs for x in environment_gaps(r["run_dir"])]
    if tool:
        overrides.setdefault("run", {})["tool_s"] = lognormal_fit(tool)
    w = override(preset("tiny"), overrides)
    out = {"measured_from": runs["elastic"]["run_dir"], "not_measured": measured["elastic"].not_measured,
           "compared": ("mean time of the steady steps (bench.repeats.steady: not the first, not the last), "
                        "against the mean of the policy's repeats"), "policies": {}}
    for name in runs:
        r = sim_run(w, policy_for(w, name), name)
        predicted = statistics.fmean(steady(list(r.step_s)))
        each = [s["steady_step_s"] for s in all_summaries[name]]
        real = statistics.fmean(each)
        out["policies"][name] = {"predicted_step_s": round(predicted, 3), "measured_step_s": round(real, 3),
                                 "error": round(abs(predicted - real) / real, 3),
                                 "error_per_repeat": [round(abs(predicted - x) / x, 3) for x in each]}
    # Never only against the configured split: the simulator's best static split on the same
    # measured workload, and elastic's forecast against it.
    from gyre_hpc.sim.compare import tuned_async
    tuned = tuned_async(w, sim_run(w, policy_for(w, "elastic"), "elastic"))
    out["sim_tuned_async"] = {k: tuned[k] for k in ("train_cells", "total_h", "elastic_over_async_tuned")}
    errors = [p["error"] for p in out["policies"].values()]
    out["max_error"] = max(errors)
    out["within_15pct"] = max(errors) <= 0.15
    return out


def ranks_main(run_dir: str, out: str) -> int:
    from gyre_hpc.cells.fleet import main_guarded
    from gyre_hpc.rl.fleet import rl_options

    return main_guarded(run_dir, rl_options(result_path=out))


@click.command()
@click.option("--steps", default=4, show_default=True,
              help="RL steps per policy (the steady figure reads the ones between the first and the last)")
@click.option("--seed", default=0, show_default=True)
@click.option("--policies", default=",".join(POLICIES), show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="keep the run directories here")
@click.option("--timeout-s", default=900.0, show_default=True, help="per policy")
@click.option("--launcher", type=click.Choice(["auto", "local", "slurm"]), default="auto", show_default=True,
              help="auto: the local Slurm cluster if it is up, else mpiexec on this machine")
@click.option("--repeats", default=3, show_default=True, help="runs of each policy (same seed): the spread")
@click.option("--workload", type=click.Choice(WORKLOADS), default="long", show_default=True,
              help="long: the long-horizon suite of make run (examples/local.yaml), policy frozen; "
                   "easy-3turn: three calls per run and a lognormal tool wait (quick)")
@click.option("--regime", type=click.Choice(["none", "paper-local"]), default="none", show_default=True,
              help="paper-local: paced cells shaped like the paper (examples/paper-local.yaml; EMULATED "
                   "durations): elastic, colocate, the simulator's best static split and its neighbours, "
                   "elastic at staleness 1 (bench.regime); --workload and --policies do not apply")
@click.option("--json", "as_json", is_flag=True)
def command(steps: int, seed: int, policies: str, out: str | None, timeout_s: float, launcher: str,
            repeats: int, workload: str, regime: str, as_json: bool) -> None:
    """Elastic vs colocate vs async on one real RL workload; the simulator's forecast beside it."""
    if regime != "none":
        regime_command(regime, steps, seed, out, timeout_s, launcher, repeats, as_json)
        return
    names = [p.strip() for p in policies.split(",") if p.strip()]
    bad = [p for p in names if p not in POLICIES]
    if bad or "elastic" not in names:
        raise click.BadParameter(f"{bad or names}: policies are {', '.join(POLICIES)}, elastic included",
                                 param_hint="--policies")
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="gyre-e2e-"))
    launcher, nodes = resolve_launcher(launcher)
    if repeats < 1:
        raise click.BadParameter("--repeats must be >= 1", param_hint="--repeats")
    load_before = os.getloadavg()[0]
    # Interleaved (elastic, colocate, async, elastic, ...) so a neighbour's burst on this
    # shared machine lands on every policy alike rather than on one.
    reps: dict[str, list[dict]] = {p: [] for p in names}
    for k in range(repeats):
        for p in names:
            reps[p].append(run_policy(root, p, steps, seed, timeout_s, launcher, nodes, name=f"{p}-{k}",
                                      workload=workload))
    load_after = os.getloadavg()[0]
    all_summaries = {p: [summarize(p, r) for r in rs] for p, rs in reps.items()}
    summaries = {p: s[0] for p, s in all_summaries.items()}
    result = {
        "benchmark": "e2e",
        "launcher": ("slurm (one het step per policy on the local cluster's nodes " + ",".join(nodes) + ")"
                     if launcher == "slurm" else "local (mpiexec on this machine)"),
        "workload": workload_summary(workload, steps, seed),
        "repeats": repeats,
        "policies": {p: {**summaries[p], "repeats": spread([s["steady_step_s"] for s in all_summaries[p]])}
                     for p in names},
        "speedup": {f"elastic_over_{b}": ratio_spread([s["steady_step_s"] for s in all_summaries[b]],
                                                      [s["steady_step_s"] for s in all_summaries["elastic"]])
                    for b in names if b != "elastic"},
        "simulator": simulate(reps, all_summaries, interval_s=0.25),
        "resources": saturation(load_before, load_after),
        "limits": limits(all_summaries, saturation(load_before, load_after)),
        "run_dirs": {p: [r["run_dir"] for r in rs] for p, rs in reps.items()},
    }
    emit(result, as_json)


def crashed_at_start(run_dir: Path) -> bool:
    """A fleet that died of a segfault before any step was written."""
    from gyre_hpc.rundir.metrics import read_table

    log = run_dir / "logs" / "fleet.log"
    metrics = run_dir / "metrics.h5"
    try:
        steps = len(read_table(metrics, "steps")["step"]) if metrics.exists() else 0
    except (OSError, KeyError):
        steps = 0
    return steps == 0 and log.exists() and "Segmentation fault" in log.read_text(errors="replace")


def regime_command(regime: str, steps: int, seed: int, out: str | None, timeout_s: float, launcher: str,
                   repeats: int, as_json: bool) -> None:
    from gyre_hpc.bench import regime as rg

    if repeats < 1:
        raise click.BadParameter("--repeats must be >= 1", param_hint="--repeats")
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"gyre-{regime}-"))
    launcher, nodes = resolve_launcher(launcher)
    w0, _ = rg.sim_workload(regime, steps)
    split = rg.best_split(w0)
    names = rg.variants(split["train_cells"], w0.fleet.cells)
    load_before = os.getloadavg()[0]
    reps: dict[str, list[dict]] = {v.name: [] for v in names}
    for k in range(repeats):
        for v in names:
            if k and not v.repeated:
                continue
            run_dir = root / f"{v.name}-{k}"
            done = run_dir / "logs" / "result.json"
            if done.is_file():     # a rerun with the same --out keeps what finished (a killed bench resumes)
                reps[v.name].append({"run_dir": str(run_dir), "result": json.loads(done.read_text())})
                continue
            shutil.rmtree(run_dir, ignore_errors=True)     # a killed run's leftovers: run it afresh
            print(f"[bench] {regime} {v.name} repeat {k + 1}/{repeats if v.repeated else 1}", file=sys.stderr)
            cfg = rg.regime_config(regime, run_dir, v, steps, seed)
            try:
                reps[v.name].append(run_config(cfg, timeout_s, launcher, nodes))
            except click.ClickException as exc:
                if not crashed_at_start(run_dir):
                    raise
                # Open MPI over PMIx here sometimes segfaults a rank in its first collective
                # (the supervisor relaunches such a fleet; so does this bench, once).
                print(f"[bench] {v.name}: {exc.message}: a crash before the first step, launching again",
                      file=sys.stderr)
                shutil.move(str(run_dir), str(run_dir.with_name(run_dir.name + "-crashed")))
                reps[v.name].append(run_config(cfg, timeout_s, launcher, nodes))
    load_after = os.getloadavg()[0]
    summaries = {v: [summarize(v, r) for r in rs] for v, rs in reps.items()}
    paces = {v: [rg.overrun(r["run_dir"]) for r in rs] for v, rs in reps.items()}
    from gyre_hpc.sim.trace import trace_batches

    w, meta = rg.sim_workload(regime, steps, measured_from=reps["elastic"][0]["run_dir"])
    sim = {"best_split_searched": split,
           "predicted_step_s": rg.forecast(w, names, trace_batches(w, reps["elastic"][0]["run_dir"])),
           "predicted_step_s_sampled": rg.forecast(w, names),
           "compared": ("mean steady step (bench.repeats.steady) against the mean of the variant's repeats; "
                        "predicted on the elastic run's own runs (sim.trace), and on runs sampled from the "
                        "measured shape beside it"), **meta}
    result = {"benchmark": "e2e", **rg.report(regime, names, summaries, sim, paces),
              "launcher": ("slurm (local cluster, packed cells)" if launcher == "slurm" else "local (mpiexec)"),
              "repeats": repeats, "steps": steps, "seed": seed,
              "resources": saturation(load_before, load_after),
              "run_dirs": {v: [r["run_dir"] for r in rs] for v, rs in reps.items()}}
    emit(result, as_json)
    if not result["valid"]:
        raise click.ClickException(
            f"the emulation is not valid: the paced cells' real compute overran the device model in "
            f"{result['overrun_share_max']:.1%} of their paced time (> {rg.MAX_OVERRUN:.0%}); slow the device "
            f"(cells.pace) or give the machine fewer cells")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ranks":
        sys.exit(ranks_main(sys.argv[2], sys.argv[3]))
    command()

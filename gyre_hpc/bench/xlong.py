"""``gyre-hpc bench xlong``: one RL step of xLong runs through the whole pipeline, measured.

The step is ``examples/xlong.yaml`` (``--config``) run for one step on the local launcher
(mpiexec on this machine): the warm start (built if the cache lacks it, and timed), then the
fleet: ``rollout.tasks_per_step`` x ``rollout.runs_per_task`` agent runs of the ``xlong`` suite
(hundreds of calls each: repositories of modules read, fixed and tested, sub-agents for whole
packages, compressions, retries) through TorchEngines, the router, the harness, the journal,
the tree builder, ``trees.zarr`` and the streaming trainer.

Then each run's own artefacts are measured in fresh processes (``bench.xlong_measure``):
calls, tokens of context and output, how it ended (its own finish, the turn budget, the wall
clock), the tree's sharing ratio, the memory its calls hold, ``build_tree`` from the journal's
increments beside the whole-prompt builder (identical trees), store append, ``pack``, and the
cost of call k against call 1 (prompt assembly, journal append, engine prefill behind the
retained context; the last 10% of a run's calls against the first 10%). Training: each
advantage group's micro-batch times (the replicas' own reports), the largest replica's peak
memory, and the step's loss against the trainer's packing recomputed from the store and the
float64 call-by-call reference. Every figure that grows with a run comes with its growth
exponent against the run's calls (least-squares slope of log figure on log calls).

``--small`` runs ``xlong-mini`` (a few dozen calls per run, a short warm start): for CI, not
for the figures.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from gyre_hpc.bench.scale import growth_exponent, in_child
from gyre_hpc.report import emit

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "xlong.yaml"
SMALL = {
    "rollout": {"tasks": "xlong-mini", "tasks_per_step": 2, "runs_per_task": 2, "context_limit": 1024,
                "run_timeout_s": 240, "subagent_turns": 16},
    "warmstart": {"tasks": "xlong-mini", "runs_per_task": 2, "steps": 60, "max_s": 120, "row_tokens": 1024},
    "train": {"row_tokens": 2048, "micro_batch_tokens": 4096},
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def bench_config(config: Path, run_dir: Path, small: bool, warmstart_cache: str | None) -> dict:
    """The config of the measured step: ``config`` for one step on the local launcher."""
    from gyre_hpc.config import load_yaml

    if not config.is_file():
        raise click.ClickException(f"--config {config} does not exist (run from a checkout, or name the file)")
    cfg = load_yaml(config.read_text())
    cfg = _merge(cfg, {"name": "bench-xlong", "run_dir": str(run_dir), "launcher": "local", "train": {"steps": 1}})
    if small:
        cfg = _merge(cfg, SMALL)
    if warmstart_cache:
        cfg = _merge(cfg, {"warmstart": {"cache_dir": warmstart_cache}})
    return cfg


def ends_inward(sizes: list[float]) -> list[int]:
    """Indices of ``sizes`` from both ends inward: the shortest, the longest, the next shortest,
    and so on. The order the runs' call costs are measured in, one after the other over ~8
    minutes: in store order the longest runs came last (the suite's tasks grow along it), so a
    host that slowed over those minutes read as cost growing with run length (a whole-call
    exponent of 1.19); from both ends a drift lands on short and long runs alike."""
    ranked = sorted(range(len(sizes)), key=lambda k: sizes[k])
    out = []
    while ranked:
        out.append(ranked.pop(0))
        if ranked:
            out.append(ranked.pop())
    return out


def _train_times(run_dir: Path, groups: list[dict]) -> list[dict]:
    """Each advantage group's training time, from the replicas' ``train_mb`` reports."""
    from gyre_hpc.rundir.load import open_run

    events = open_run(run_dir).events
    by_mb: dict[int, tuple[int, float]] = {}
    for name, detail in zip(events["event"].values.tolist(), events["detail"].values.tolist()):
        if str(name) != "train_mb":
            continue
        fields = dict(kv.split("=", 1) for kv in str(detail).split())
        by_mb[int(fields["mb"])] = (int(fields["tokens"]), float(fields["seconds"]))
    out, first = [], 0
    for g in groups:
        ids = range(first, first + g["micro_batches"])
        first += g["micro_batches"]
        out.append({**g, "train_s": sum(by_mb[i][1] for i in ids if i in by_mb),
                    "train_tokens": sum(by_mb[i][0] for i in ids if i in by_mb),
                    "reported": sum(i in by_mb for i in ids)})
    return out


def _quantiles(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "mean": statistics.fmean(values),
            "max": max(values)}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--small", is_flag=True, help="xlong-mini: a few dozen calls per run and a short warm start (CI)")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=str(EXAMPLE), show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default=None, help="keep the run directory here")
@click.option("--warmstart-cache", default=None, help="warm-start cache directory (default: the config's)")
@click.option("--timeout-s", default=2400.0, show_default=True, help="the fleet's wall-clock limit")
def command(as_json: bool, small: bool, config_path: str, out: str | None, warmstart_cache: str | None,
            timeout_s: float) -> None:
    """One RL step of xLong runs: calls, tokens, sharing, per-call cost, memory, build/store/pack/train growth."""
    from gyre_hpc.bench.e2e import run_config
    from gyre_hpc.bench.xlong_measure import check_loss, measure_call_costs, measure_run, time_builds
    from gyre_hpc.config import build_config
    from gyre_hpc.models.tokenizer import load_tokenizer
    from gyre_hpc.rl.runs import sample_runs
    from gyre_hpc.rl.tasks import load_tasks
    from gyre_hpc.rundir.layout import RunDir
    from gyre_hpc.rundir.load import open_run
    from gyre_hpc.trees.store import TreeStore
    from gyre_hpc.warmstart.cache import warmstart_source, with_warmstart

    t_bench = time.perf_counter()
    tmp = None
    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="gyre-bench-xlong-")
        out = tmp.name
    run_dir = Path(out) / "run"
    config = bench_config(Path(config_path), run_dir, small, warmstart_cache)
    cfg = build_config(config)
    source = warmstart_source(cfg) if cfg.warmstart.enabled else None
    t0 = time.perf_counter()
    model_dir = with_warmstart(cfg, log=lambda m: print(m, file=sys.stderr)).model.path
    warm_s = time.perf_counter() - t0
    warm_report = json.loads((Path(model_dir) / "warmstart.json").read_text()) if model_dir and \
        (Path(model_dir) / "warmstart.json").is_file() else None
    t0 = time.perf_counter()
    fleet = run_config(config, timeout_s)
    fleet_s = time.perf_counter() - t0
    run = RunDir.at(run_dir)
    metrics = open_run(run_dir)
    steps = metrics.steps
    step_loss = float(steps["loss"].values[-1])
    step_wall = float(steps["wall_s"].values[-1])
    runs_table = metrics.runs
    starts = runs_table["started"].values.astype(np.float64)
    ends = starts + runs_table["wall_s"].values.astype(np.float64)
    with TreeStore.open(run.trees) as store:
        order = store.run_ids()
    tasks = load_tasks(cfg.rollout.tasks)       # the fleet's own loader: the same tasks, the same runs
    max_turns = {t.task_id: t.max_turns for t in tasks}
    # What each run's calls were sampled with, for the whole-call replay (the step is the first).
    run_seeds = {spec.run_id: spec.seed for spec in sample_runs(tasks, cfg, 1)}
    sampling = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                "max_new_tokens": cfg.rollout.max_new_tokens, "stop": list(load_tokenizer(model_dir).stop_ids())}
    work = Path(out) / "measure"
    work.mkdir(parents=True, exist_ok=True)

    t_measure = time.perf_counter()
    measured = {}
    sizes = [(run.journals / f"{rid}.journal").stat().st_size for rid in order]
    for rid in (order[k] for k in ends_inward(sizes)):
        journal = str(run.journals / f"{rid}.journal")
        task_id = str(runs_table["task_id"].values[list(runs_table["run_id"].values).index(rid)])
        r = in_child(measure_run, journal, max_turns[task_id], cfg.train.row_tokens, str(work),
                     label=f"bench xlong: run {rid}")
        r["call_cost"] = in_child(measure_call_costs, journal, model_dir, cfg.model.numerics == "invariant",
                                  str(work), {**sampling, "run_seed": run_seeds[rid]},
                                  label=f"bench xlong: call costs {rid}")
        measured[rid] = r
    runs = [measured[rid] for rid in order]
    builds = in_child(time_builds, [str(run.journals / f"{rid}.journal") for rid in order],
                      label="bench xlong: builds")
    for k, r in enumerate(runs):
        r["build_s"], r["build_whole_prompts_s"] = builds["build_s"][k], builds["build_whole_prompts_s"][k]
    train = {k: getattr(cfg.train, k) for k in ("shared_targets", "averaging", "row_tokens", "micro_batch_tokens",
                                                  "group_forest", "clip_eps")}
    attention = "invariant" if cfg.model.numerics == "invariant" else cfg.train.attention
    loss = in_child(check_loss, model_dir, [str(run.journals / f"{rid}.journal") for rid in order], str(run.trees),
                    train, attention, label="bench xlong: loss")
    measure_s = time.perf_counter() - t_measure
    groups = _train_times(run_dir, loss.pop("groups"))
    for g in groups:
        g["calls"] = sum(r["calls"] for r in runs if r["run_id"] in g["run_ids"])

    calls = [r["calls"] for r in runs]
    series = {name: {"values": [r[name] for r in runs], "growth_exponent": growth_exponent(calls, [r[name] for r in runs])}
              for name in ("build_s", "build_whole_prompts_s", "harness_held_mb", "harness_rss_mb", "journal_bytes",
                           "store_append_s", "pack_s", "tree_tokens", "context_tokens")}
    per_call = [r["call_cost"]["total_s"] for r in runs]
    series["call_cost_s"] = {"values": per_call, "growth_exponent": growth_exponent(calls, per_call)}
    whole = [r["call_cost"]["whole_call"]["total_s"] for r in runs]
    series["whole_call_s"] = {"values": whole, "growth_exponent": growth_exponent(calls, whole)}
    series["train_s_by_group"] = {"calls": [g["calls"] for g in groups], "values": [g["train_s"] for g in groups],
                                  "growth_exponent": growth_exponent([g["calls"] for g in groups],
                                                                     [g["train_s"] for g in groups])}
    totals = fleet["result"].get("totals", {})
    ended = {k: sum(r["ended_by"] == k for r in runs) for k in ("finish", "turn_budget", "wall_clock", "failed", "other")}
    ratios = [r["call_cost"]["total"]["last_over_first"] for r in runs]
    same_ctx = [r["call_cost"]["total"]["same_context_last_over_first"] for r in runs]
    whole_ratios = [r["call_cost"]["whole_call"]["last_over_first"] for r in runs]
    reproduced = sum(r["call_cost"]["whole_call"]["outputs_reproduced"] for r in runs)
    # The step's own loss is ~0 on-policy (minus the mean advantage): compared absolutely. The
    # probe's is not: compared relatively.
    diff = {k: abs(loss["trainer_forward"][k] - loss["reference"][k]) for k in loss["reference"]}
    probe_rel = diff["probe"] / max(abs(loss["reference"]["probe"]), 1e-300)
    bench_s = time.perf_counter() - t_bench
    report = {
        "workload": {
            "config": str(config_path), "small": small, "suite": cfg.rollout.tasks,
            "runs": len(runs), "context_limit": cfg.rollout.context_limit, "model": cfg.model.preset,
            "numerics": cfg.model.numerics, "launcher": "local (mpiexec on this machine)",
            "growth_exponent": "least-squares slope of log(figure) on log(calls per run) over the step's runs",
            "call_cost": "each call of a run replayed from its journal in order (each part the least of 3 replays "
                         "of the whole run): prompt assembled from its context "
                         "segments and made a request (assemble), its journal record appended with fsync "
                         "(journal_append), TorchEngine prefill behind the session's retained context with the "
                         "step's starting weights (engine_prefill); first/last 10% of the run's calls; "
                         "same_context_last_over_first: the same at equal context length (cost fitted as "
                         "a + b*context + c*k over the run's calls, at the run's mean context); "
                         "whole_call: each call whole, the least of 2 more replays: the live request (its seed, "
                         "sampling and stop tokens) prefilled and decoded by the engine, so its output is "
                         "the journal's (outputs_reproduced counts the calls where it is) and the engine "
                         "retains what the live one did: the cost a live call has on one engine alone",
            "harness_held_mb": "memory a run's loaded calls hold (increments, as the live harness holds them), "
                               "traced by tracemalloc; harness_rss_mb: the RSS they add",
            "train_peak_rss_mb": "the largest TRAIN replica's peak resident memory over the step (ru_maxrss of the "
                                 "process: model, optimizer, activations, and the engine it also hosts)",
        },
        "runs": runs,
        "summary": {
            "calls_per_run": _quantiles(calls),
            "context_tokens_per_run": _quantiles([r["context_tokens"] for r in runs]),
            "output_tokens_per_run": _quantiles([r["output_tokens"] for r in runs]),
            "sharing_ratio": _quantiles([r["sharing_ratio"] for r in runs]),
            "ended_by": ended, "reward_mean": statistics.fmean(r["reward"] or 0.0 for r in runs),
            "call_cost_last_over_first": _quantiles([x for x in ratios if x is not None]),
            "call_cost_same_context_last_over_first": _quantiles([x for x in same_ctx if x is not None]),
            "whole_call_last_over_first": _quantiles([x for x in whole_ratios if x is not None]),
            "whole_call_outputs_reproduced": f"{reproduced} of {sum(calls)}",
            "controller_peak_rss_mb": totals.get("controller_peak_rss_kib", 0) / 1024,
            "train_peak_rss_mb": totals.get("train_peak_rss_kib", 0) / 1024,
            "cached_prompt_tokens": totals.get("cached_prompt_tokens"),
            "recomputed_prefill_tokens": totals.get("recomputed_prefill_tokens"),
        },
        "vs_calls": series,
        "training": {"groups": groups, "step_loss": step_loss, **loss,
                     "step_abs_diff_vs_reference": diff["step"], "probe_rel_diff_vs_reference": probe_rel,
                     "step_loss_abs_diff_vs_trainer_forward": abs(step_loss - loss["trainer_forward"]["step"])},
        "time_s": {
            "bench": bench_s, "warm_start": warm_s, "warm_start_built": source == "build",
            "warm_start_source": source,
            "warm_start_teacher_and_sft": None if warm_report is None else warm_report.get("seconds"),
            "fleet": fleet_s, "step": step_wall, "rollouts": float(ends.max() - starts.min()) if len(starts) else None,
            "fleet_start_and_stop": fleet_s - step_wall, "measure": measure_s,
        },
        "targets": {
            "median_calls_ge_200": statistics.median(calls) >= 200, "max_calls_ge_400": max(calls) >= 400,
            "context_tokens_ge_500k_median": statistics.median(r["context_tokens"] for r in runs) >= 500_000,
            "ended_by_the_run_most": ended["finish"] > len(runs) / 2,
            "ended_not_by_the_wall_clock_most": ended["wall_clock"] < len(runs) / 2,
            "exponents_le_1_15": {k: series[k]["growth_exponent"] for k in
                                  ("build_s", "harness_held_mb", "journal_bytes", "call_cost_s", "whole_call_s")},
            "call_cost_last_over_first_le_1_2_max": max(x for x in ratios if x is not None),
            "call_cost_same_context_last_over_first_le_1_2_max": max(x for x in same_ctx if x is not None),
            "whole_call_last_over_first_le_1_2_max": max(x for x in whole_ratios if x is not None),
            "train_peak_rss_lt_4gb": totals.get("train_peak_rss_kib", 0) < 4 * 2**20,
            "loss_equals_reference": {"probe_rel_diff": probe_rel, "step_abs_diff": diff["step"]},
            "bench_within_15_min": bench_s <= 900,
        },
    }
    if tmp is not None:
        tmp.cleanup()
    emit(report, as_json)

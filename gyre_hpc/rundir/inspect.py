"""``gyre-hpc inspect RUN_DIR``: what a run did, from its files alone (config, metrics, checkpoints).

Works on a live run (metrics.h5 is read in SWMR mode) and on one whose writer was killed.
A directory that is not a run, or a file that cannot be read, is reported by name.
"""
from __future__ import annotations

import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from gyre_hpc.config import ConfigError, load_config
from gyre_hpc.rundir.layout import CHECKPOINT_LATEST, CHECKPOINT_META, RunDir
from gyre_hpc.rundir.metrics import read_table


class RunDirError(ValueError):
    """Not a run directory, or one of its files is unreadable; the message names the file."""


@dataclass
class CellSummary:
    cell: int
    to_train: int
    to_rollout: int
    bytes_moved: int


@dataclass
class RunSummary:
    run_dir: str
    name: str
    launcher: str
    policy: str
    cells: int
    ranks_per_cell: int
    steps_planned: int
    steps_done: int                      # distinct steps with a row in the steps table
    repeated_steps: list[int]            # steps with more than one row (should be empty)
    last_step: int | None
    checkpoint_step: int | None
    launches: int
    relaunches: int
    requeues: int
    status: str                          # the last supervisor event, or "running"/"not started"
    events: list[tuple[float, str, int, str]] = field(default_factory=list)
    cell_flips: list[CellSummary] = field(default_factory=list)
    # rl workload: one entry per step row (step, reward_mean, loss, tokens, replicas, wall_s),
    # the tree store's committed contents and the per-run flip effects.
    steps: list[dict] = field(default_factory=list)
    trees: dict | None = None
    runs: dict | None = None
    # What the flips did to the rollouts (``flip_effects``): migrations, restarts,
    # recomputed prefill, flapping. None for a run without a timeline.
    flip_effects: dict | None = None
    # Streaming training: when each replica's last micro-batch of a step ended (``train_mb``
    # events) and how far apart, as a share of the step's training span. None without events.
    replica_finish: dict | None = None
    # Paced cells (cells.device: paced): each launch's last records, summed; EMULATED durations.
    pace: dict | None = None


# The train-inference gap of each step (metrics.TABLES["steps"]): None where not measured.
GAP_COLUMNS = ("logprob_gap_max", "logprob_gap_mean", "pre_update_clip_share", "behaviour_kl")


def _finite_or_none(value) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


_SUPERVISOR_END = {"finish": "finished", "fail": "failed", "requeue": "requeued", "stop": "stopped"}


def summarize(path: str | Path) -> RunSummary:
    run = RunDir.at(path)
    if not run.root.is_dir():
        raise RunDirError(f"{run.root} does not exist or is not a directory")
    if not run.config.is_file():
        raise RunDirError(f"{run.root} is not a run directory: it has no config.yaml "
                          "(a run directory holds config.yaml, metrics.h5, checkpoints/, logs/)")
    try:
        cfg = load_config(run.config)
    except ConfigError as exc:
        raise RunDirError(f"{run.config} is unreadable: {exc}") from None
    tables = {}
    if run.metrics.exists():
        for table in ("events", "steps", "timeline"):
            try:
                tables[table] = read_table(run.metrics, table)
            except (OSError, KeyError) as exc:
                raise RunDirError(f"{run.metrics} is corrupt or unreadable ({table} table): {exc}") from None
        try:
            tables["runs"] = read_table(run.metrics, "runs")
        except (OSError, KeyError):
            pass    # written before the runs table existed
    checkpoint_step = _checkpoint_step(run)

    ev = tables.get("events")
    events = [] if ev is None else [(float(t), str(e), int(s), str(d))
                                    for t, e, s, d in zip(ev["time"], ev["event"], ev["step"], ev["detail"])]
    names = [e for _, e, _, _ in events]
    step_counts = Counter(int(s) for s in tables["steps"]["step"]) if "steps" in tables else Counter()
    status = "not started"
    for _, name, _, _ in events:
        if name in ("launch", "relaunch", "resume"):
            status = "running (or killed)"
        status = _SUPERVISOR_END.get(name, status)

    flips: dict[int, CellSummary] = {}
    if "timeline" in tables:
        t = tables["timeline"]
        for cell, role, event, nbytes in zip(t["cell"], t["role"], t["event"], t["bytes"]):
            if event != "flip_end":
                continue
            s = flips.setdefault(int(cell), CellSummary(int(cell), 0, 0, 0))
            if role == "TRAIN":
                s.to_train += 1
            elif role == "ROLLOUT":
                s.to_rollout += 1
            s.bytes_moved += int(nbytes)

    steps = []
    if "steps" in tables:
        t = tables["steps"]
        steps = [{"step": int(t["step"][i]), "reward_mean": float(t["reward_mean"][i]), "loss": float(t["loss"][i]),
                  "tokens": int(t["tokens"][i]), "replicas": int(t["replicas"][i]), "wall_s": float(t["wall_s"][i]),
                  **{name: _finite_or_none(t[name][i]) for name in GAP_COLUMNS}}
                 for i in range(len(t["step"]))]
    runs = None
    if "runs" in tables and len(tables["runs"]["run_id"]):
        r = tables["runs"]
        runs = {"runs": int(len(r["run_id"])), "requests_moved": int(r["migrations"].sum()),
                "restarts": int(r["restarts"].sum()), "statuses": dict(Counter(str(x) for x in r["status"]))}

    replica = replica_finish(events, step_start_times(tables["steps"]) if "steps" in tables else None) if events else None
    pace = pace_summary(events) if events else None
    effects = None
    if "timeline" in tables:
        effects = flip_effects(tables["timeline"], tables.get("runs"), tables.get("steps"))
    return RunSummary(
        steps=steps, trees=_trees_summary(run), runs=runs, flip_effects=effects, replica_finish=replica,
        pace=pace,
        run_dir=str(run.root), name=cfg.name, launcher=cfg.launcher, policy=cfg.scheduler.policy,
        cells=cfg.cells.count, ranks_per_cell=cfg.cells.ranks_per_cell, steps_planned=cfg.train.steps,
        steps_done=len(step_counts), repeated_steps=sorted(s for s, n in step_counts.items() if n > 1),
        last_step=max(step_counts) if step_counts else None, checkpoint_step=checkpoint_step,
        launches=names.count("launch") + names.count("relaunch"), relaunches=names.count("relaunch"),
        requeues=names.count("requeue"), status=status, events=events,
        cell_flips=[flips[c] for c in sorted(flips)])


def _fields(detail: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in detail.split() if "=" in kv)


LAUNCH_EVENTS = ("fleet_start", "fleet_resume")


def by_launch(events: list[tuple[float, str, int, str]]) -> list[list[tuple[float, str, int, str]]]:
    """The events in fleet launches, split at each ``fleet_start``/``fleet_resume``. A relaunch
    after a kill trains the steps past the checkpoint again (their first attempt's events stay
    in the table), and its ranks' pace records count from zero."""
    launches: list[list[tuple[float, str, int, str]]] = [[]]
    for e in events:
        if e[1] in LAUNCH_EVENTS and launches[-1]:
            launches.append([])
        launches[-1].append(e)
    return launches


def replica_finish(events: list[tuple[float, str, int, str]],
                   step_starts: dict[int, float] | None = None) -> dict | None:
    """Per step with >= 2 training cells: each cell's last micro-batch end (the controller's
    receipt of its report), their spread, and the spread as a share of the step's training
    span (first micro-batch start to last end). Dealing by measured speed should keep every
    replica finishing together, a slower one included. A step trained again after a relaunch
    is read from the launch that trained it last.

    Two denominators, because "ends within 10% of each other" has two readings. ``share``
    divides by the training span, the stricter: under elastic the span starts when the first
    group's rollouts end, well into the step. ``share_of_step`` (with ``step_starts``, the
    step's start on the events' clock) divides by the step's time up to its last end: the ends
    read as times from the step's start, and the idle tail as a share of the step's capacity.

    Micro-batches are indivisible, so a spread can come from the step's work running out
    rather than from the dealing: ``started_after_first_end`` counts the micro-batches that
    began after the first replica ran out (0: nothing was left for it to take), and
    ``longest_in_flight_s`` is the longest of those still training at that moment, the
    granularity the spread then reflects."""
    by_step: dict[int, dict[int, list[tuple[float, float]]]] = {}
    for launch in by_launch(events):
        steps: dict[int, dict[int, list[tuple[float, float]]]] = {}
        for t, name, step, detail in launch:
            if name == "train_mb":
                f = _fields(detail)
                steps.setdefault(step, {}).setdefault(int(f["cell"]), []).append((t, float(f["seconds"])))
        by_step.update(steps)
    if not by_step:
        return None
    out = {}
    for step, cells in sorted(by_step.items()):
        if len(cells) < 2:
            continue
        ends = {c: max(t for t, _ in mbs) for c, mbs in cells.items()}
        start = min(t - sec for mbs in cells.values() for t, sec in mbs)
        span = max(ends.values()) - start
        first_end = min(ends.values())
        spread = max(ends.values()) - first_end
        after = [sec for mbs in cells.values() for t, sec in mbs if t - sec > first_end]
        in_flight = [sec for mbs in cells.values() for t, sec in mbs if t - sec <= first_end < t]
        out[step] = {"last_end_s": {c: round(e - start, 3) for c, e in sorted(ends.items())},
                     "spread_s": round(spread, 3), "share": round(spread / span, 4) if span > 0 else 0.0,
                     "started_after_first_end": len(after),
                     "longest_in_flight_s": round(max(in_flight, default=0.0), 3)}
        if step_starts and step in step_starts:
            to_end = max(ends.values()) - step_starts[step]
            out[step]["share_of_step"] = round(spread / to_end, 4) if to_end > 0 else 0.0
    of_step = [v["share_of_step"] for v in out.values() if "share_of_step" in v]
    return {"steps": out, "max_share": max((v["share"] for v in out.values()), default=None),
            "max_share_of_step": max(of_step) if len(of_step) == len(out) and out else None}


def step_start_times(steps: dict) -> dict[int, float]:
    """Each step's start (its row's time less its wall_s) from a ``steps`` table; a step with
    several rows (trained again after a relaunch) by its last."""
    return {int(s): float(t) - float(w) for s, t, w in zip(steps["step"], steps["time"], steps["wall_s"])}


PACE_SUMS = ("intervals", "paced_s", "real_s", "overruns", "overrun_s")


def pace_summary(events: list[tuple[float, str, int, str]]) -> dict | None:
    """The paced cells' records, each launch's last (they are cumulative within a launch)
    summed over launches, and the overrun share over all of them: above a few percent the
    emulation is not valid."""
    totals: dict[tuple[int, str], dict[str, float]] = {}
    step_of = -1
    for launch in by_launch(events):
        last: dict[tuple[int, str], dict[str, str]] = {}
        for _, name, step, detail in launch:
            if name == "pace":
                f = _fields(detail)
                last[(int(f["cell"]), detail.split()[2])] = f
                step_of = max(step_of, step)
        for key, f in last.items():
            total = totals.setdefault(key, dict.fromkeys(PACE_SUMS, 0.0))
            for k in PACE_SUMS:
                total[k] += float(f[k])
    if not totals:
        return None
    for total in totals.values():
        total["share"] = round(total["overrun_s"] / total["paced_s"], 4) if total["paced_s"] > 0 else 0.0
    paced = sum(f["paced_s"] for f in totals.values())
    over = sum(f["overrun_s"] for f in totals.values())
    return {"emulated": True, "step": step_of, "cells": {f"{c}:{role}": f for (c, role), f in sorted(totals.items())},
            "paced_s": round(paced, 3), "overrun_s": round(over, 3),
            "overrun_share": round(over / paced, 4) if paced > 0 else 0.0}


def flip_effects(timeline: dict, runs: dict | None = None, steps: dict | None = None) -> dict:
    """The flips of a run and what they cost the rollouts, from the metrics tables.

    One vocabulary for what moves with its KV cache when an engine is released (the same
    words in the live table, the progress lines, ``inspect`` and docs/rl.md):
    ``requests_moved``: in-flight requests moved mid-decode; ``contexts_moved``: retained
    agent contexts (a session's KV between its calls) moved; ``kv_moved``: the two together;
    ``kv_moved_tokens`` (of which ``contexts_moved_kv_tokens``) and ``kv_moved_bytes``: their
    cached KV; ``releases_moving_kv``: the releases (``migrate`` rows with anything moved) that
    did it; ``run_requests_moved``: the runs table's count of its requests moved, which must
    equal ``requests_moved``. ``restarts`` (runs table): model calls
    submitted again from scratch. ``recomputed_prefill_tokens`` (steps table): prefill the
    engines did twice. ``flaps``: a cell released (ROLLOUT -> TRAIN) and reclaimed in the same
    step, i.e. an engine given up and needed back for the same batch. ``reversals``: any flip
    that undoes the cell's previous flip in the same step, flaps included; the elastic cycle
    (back for a new batch at its start, released at its tail) makes one per cell and step.
    A fleet launch (``start`` rows) begins each cell's count afresh.
    """
    last: dict[int, tuple[int, str]] = {}       # cell -> (step, role) of its latest flip this launch
    out = {"flips": 0, "releases": 0, "reclaims": 0, "releases_moving_kv": 0, "requests_moved": 0,
           "contexts_moved": 0, "kv_moved": 0, "kv_moved_tokens": 0, "contexts_moved_kv_tokens": 0,
           "kv_moved_bytes": 0, "flaps": 0, "reversals": 0}
    n = len(timeline["cell"])
    sessions = timeline.get("sessions", [0] * n)
    session_tokens = timeline.get("session_tokens", [0] * n)
    for cell, role, event, step, requests, tokens, nbytes, n_sessions, s_tokens in zip(
            timeline["cell"], timeline["role"], timeline["event"], timeline["step"], timeline["requests"],
            timeline["tokens"], timeline["bytes"], sessions, session_tokens):
        cell, step, role = int(cell), int(step), str(role)
        if event == "start":
            last.pop(cell, None)
        elif event == "migrate" and int(requests) > 0:
            out["releases_moving_kv"] += 1
            out["requests_moved"] += int(requests) - int(n_sessions)
            out["contexts_moved"] += int(n_sessions)
            out["kv_moved"] += int(requests)
            out["kv_moved_tokens"] += int(tokens)
            out["contexts_moved_kv_tokens"] += int(s_tokens)
            out["kv_moved_bytes"] += int(nbytes)
        elif event == "flip_end":
            out["flips"] += 1
            out["releases" if role == "TRAIN" else "reclaims"] += 1
            prev = last.get(cell)
            if prev is not None and prev[0] == step and prev[1] != role:
                out["reversals"] += 1
                out["flaps"] += int(prev[1] == "TRAIN" and role == "ROLLOUT")
            last[cell] = (step, role)
    has_runs = runs is not None and len(runs["run_id"]) > 0
    out["run_requests_moved"] = int(runs["migrations"].sum()) if has_runs else 0
    out["restarts"] = int(runs["restarts"].sum()) if has_runs else 0
    out["recomputed_prefill_tokens"] = (int(steps["recomputed_prefill_tokens"].sum())
                                        if steps is not None and len(steps["step"]) else 0)
    return out


def _trees_summary(run: RunDir) -> dict | None:
    if not run.trees.exists():
        return None
    from gyre_hpc.rundir.tree_stats import store_stats
    from gyre_hpc.trees.store import StoreError, TreeStore

    try:
        with TreeStore.open(run.trees, "r") as store:
            n = len(store)
            ids = store.run_ids()
            ds = store.dataset()
            rewards = ds["reward"].values if n else []
            tokens = int(ds["trained"].values.sum()) if n else 0
            shapes = store_stats(ds) if n else {"runs": 0}
    except (StoreError, OSError, KeyError) as exc:
        raise RunDirError(f"{run.trees} is unreadable: {exc}") from None
    return {"trees": n, "unique_run_ids": len(set(ids)), "trained_tokens": tokens,
            "reward_mean": float(sum(rewards) / n) if n else None, "shapes": shapes}


def _checkpoint_step(run: RunDir) -> int | None:
    latest = run.checkpoints / CHECKPOINT_LATEST
    if not latest.is_file():
        return None
    name = latest.read_text().strip()
    meta = run.checkpoints / name / CHECKPOINT_META
    try:
        return int(json.loads(meta.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirError(f"{latest} names {name!r}, but {meta} is unreadable: {exc}") from None


def render(summary: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    overview = Table(title=f"run {summary.name}", show_header=False)
    overview.add_column("field", style="bold")
    overview.add_column("value")
    repeated = f" (REPEATED: {summary.repeated_steps})" if summary.repeated_steps else ""
    for key, value in (
        ("run dir", summary.run_dir), ("status", summary.status),
        ("launcher / policy", f"{summary.launcher} / {summary.policy}"),
        ("cells", f"{summary.cells} x {summary.ranks_per_cell} rank(s)"),
        ("steps done", f"{summary.steps_done} of {summary.steps_planned}{repeated}"),
        ("latest checkpoint", "none" if summary.checkpoint_step is None else f"step {summary.checkpoint_step}"),
        ("launches", f"{summary.launches} ({summary.relaunches} relaunch(es), {summary.requeues} requeue(s))"),
    ):
        overview.add_row(key, str(value))
    console.print(overview)

    if summary.cell_flips:
        cells = Table(title="cell timeline")
        for col in ("cell", "flips to TRAIN", "flips to ROLLOUT", "MB moved"):
            cells.add_column(col, justify="right")
        for c in summary.cell_flips:
            cells.add_row(str(c.cell), str(c.to_train), str(c.to_rollout), f"{c.bytes_moved / 1e6:.1f}")
        console.print(cells)

    if summary.steps:
        steps = Table(title="steps")
        for col in ("step", "reward mean", "loss", "trained tokens", "replicas", "wall s", "logprob gap max",
                    "gap mean", "clipped pre-update", "KL(b||t)"):
            steps.add_column(col, justify="right")
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        for row in summary.steps:
            steps.add_row(str(row["step"]), f"{row['reward_mean']:.3f}", f"{row['loss']:.4g}", str(row["tokens"]),
                          str(row["replicas"]), f"{row['wall_s']:.1f}", fmt(row.get("logprob_gap_max"), ".3g"),
                          fmt(row.get("logprob_gap_mean"), ".3g"), fmt(row.get("pre_update_clip_share"), ".2%"),
                          fmt(row.get("behaviour_kl"), ".3g"))
        console.print(steps)
    if summary.trees is not None:
        t = summary.trees
        reward = "-" if t["reward_mean"] is None else f"{t['reward_mean']:.3f}"
        console.print(f"trees.zarr: {t['trees']} committed trees ({t['unique_run_ids']} distinct runs), "
                      f"{t['trained_tokens']} trained tokens, mean reward {reward}")
        sh = t.get("shapes") or {}
        if sh.get("runs"):
            c, w, a = sh["calls_per_run"], sh["runs_with"], sh["admission"]
            console.print(f"run shapes: calls per run mean {c['mean']:.1f} p50 {c['p50']:.0f} p90 {c['p90']:.0f} "
                          f"max {c['max']}; runs with compression {w['compression']:.0%}, sub-agent "
                          f"{w['subagent']:.0%}, retry {w['retry']:.0%}, timeout {w['timeout']:.0%}; sharing "
                          f"{sh['sharing_ratio']:.2f}x, trained share {sh['trained_share']:.1%}; admission dropped "
                          f"{a['dropped_calls']} of {a['calls_total']} calls ({a['runs_with_drops']} runs)")
    if summary.runs is not None:
        r = summary.runs
        console.print(f"agent runs: {r['runs']} ({r['statuses']}), requests moved mid-decode {r['requests_moved']}, "
                      f"restarts {r['restarts']}")
    f = summary.flip_effects
    if f and f["flips"]:
        console.print(f"flips: {f['flips']} ({f['releases']} to TRAIN, {f['reclaims']} to ROLLOUT); KV moved: "
                      f"{f['requests_moved']} requests mid-decode + {f['contexts_moved']} retained contexts = "
                      f"{f['kv_moved']} ({f['kv_moved_tokens']} KV tokens, {f['kv_moved_bytes'] / 1e6:.1f} MB) in "
                      f"{f['releases_moving_kv']} releases; restarts "
                      f"{f['restarts']}, recomputed prefill tokens {f['recomputed_prefill_tokens']}, flaps "
                      f"{f['flaps']} (released and reclaimed in one step)")

    rf = summary.replica_finish
    if rf and rf["steps"]:
        of_step = "" if rf.get("max_share_of_step") is None else f", {rf['max_share_of_step']:.0%} of the step"
        console.print(f"replicas' last micro-batch: spread up to {rf['max_share']:.0%} of a step's training span"
                      f"{of_step} ({len(rf['steps'])} steps with >= 2 replicas)")
        for step, f in rf["steps"].items():
            step_share = f" and {f['share_of_step']:.1%} of the step" if "share_of_step" in f else ""
            console.print(f"  step {step}: spread {f['spread_s']:.2f} s ({f['share']:.1%} of training{step_share}); "
                          f"after the first replica "
                          f"ran out, {f['started_after_first_end']} micro-batches started, the longest in flight "
                          f"{f['longest_in_flight_s']:.2f} s")
    if summary.pace:
        p = summary.pace
        console.print(f"paced cells (EMULATED durations): {p['paced_s']:.1f} s held, overrun {p['overrun_s']:.1f} s "
                      f"= {p['overrun_share']:.1%} (above ~5% the emulation is not valid)")

    if summary.events:
        import time as _time

        events = Table(title="events")
        for col in ("time", "event", "step", "detail"):
            events.add_column(col)
        for t, name, step, detail in summary.events:
            if name in ("train_mb", "pace"):
                continue    # one per micro-batch / paced cell: summarized above
            events.add_row(_time.strftime("%H:%M:%S", _time.localtime(t)), name, "" if step < 0 else str(step), detail)
        console.print(events)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print the summary as JSON")
def inspect(run_dir: Path, as_json: bool) -> None:
    """Summarize a run directory: config, steps done, checkpoints, relaunches, cell timeline, events."""
    try:
        summary = summarize(run_dir)
    except RunDirError as exc:
        click.echo(f"inspect: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(asdict(summary), indent=2))
    else:
        render(summary)

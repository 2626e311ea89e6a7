"""``gyre-hpc bench chaos``: an RL run on the local Slurm cluster under a seeded schedule of
faults, then every committed tree, step row and run row counted.

Each fault test of the suite kills one thing once, on an idle machine. A 20-hour job meets
many: this submits ``sbatch/gyre_head.sh`` and, while the run goes on, SIGKILLs fleet ranks,
``scancel``s the fleet's srun step and SIGKILLs the head itself, at seeded moments. A killed
rank or step is the supervisor's to relaunch (``supervise.max_relaunches`` is raised so the
schedule cannot exhaust it); a killed head ends its batch job, and the bench resubmits the same
command, as a user would (the fleet dies with its head: its lease runs out). Once the schedule
is spent the run must reach its last step, and then:

- ``trees.zarr``: every run of every step exactly once (the store's run ids), readable by
  xarray (``rundir.load.open_trees``);
- ``metrics.h5``: each step's row once, each step's runs' rows once;
- the final checkpoint: its step is the last one and its weights load (``load_pretrained``);
- resume, not restart (issue 53): the runs a relaunch found mid-way (calls in their journal)
  are counted from their run rows, with the calls each made again (``tools_redone``: journaled
  calls whose tools ran again after the workspace snapshot; no journaled call goes to the
  engine again) and the runs whose journal was abandoned and that began again at call 0. The
  runs are of the ``long`` suite (14-24 model calls each) so a kill lands mid-run. Not counted:
  a call the kill caught in flight (never journaled), which the resumed run asks again.

Moments: a fault waits for its target (``flip``: a ``flip_start`` row with no ``flip_end``;
``checkpoint``: a checkpoint staging directory on disk; ``migration``: a ``migrate`` row just
appended; ``append``: the store's length just grew, so the next group's append is under way or
near) up to ``MOMENT_WAIT_S`` and lands anyway when it does not come; what was really going on
at the kill is classified from the same signals and reported (``moments_hit``), so the report
says which moments were hit, not which were meant.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from gyre_hpc.jobs.submit import ENDED_STATES, job_state
from gyre_hpc.report import emit

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "sbatch/gyre_head.sh"
CONFIG = "examples/local-slurm.yaml"
# The config's run made small: 2 tasks x 4 runs of tens of model calls (the long suite's
# turn budgets, 14-24; a tiny model's output is mostly answer-file text), a step in seconds.
SMALL = ("rollout.tasks=long", "rollout.runs_per_task=4", "rollout.max_new_tokens=24")
KINDS = ("rank", "step", "head")
MOMENTS = ("any", "flip", "checkpoint", "migration", "append")
MOMENT_WAIT_S = 15.0


@dataclass(frozen=True)
class Fault:
    kind: str          # rank: SIGKILL one fleet rank; step: scancel the srun step; head: SIGKILL the head
    moment: str        # what the fault waits for (MOMENTS)
    delay_s: float     # after the fleet it hits is seen running


def fault_schedule(seed: int, n: int, head_share: float = 0.15) -> list[Fault]:
    """``n`` faults, a pure function of ``seed``: every kind and every moment at least once
    when ``n`` allows, head kills about ``head_share`` of the rest (each costs a resubmission)."""
    rng = random.Random(seed)
    kinds = list(KINDS)[:n] + [("head" if rng.random() < head_share else rng.choice(("rank", "step")))
                               for _ in range(max(0, n - len(KINDS)))]
    rng.shuffle(kinds)
    moments = [MOMENTS[i % len(MOMENTS)] for i in range(n)]
    rng.shuffle(moments)
    return [Fault(k, m, round(rng.uniform(1.0, 8.0), 2)) for k, m in zip(kinds, moments)]


# ---- what is going on in the run ---------------------------------------------------------
def _timeline(run_dir: Path) -> dict:
    """The timeline rows of the running fleet (since its latest ``fleet_start``/``fleet_resume``):
    a fleet killed mid-flip leaves a ``flip_start`` without its end behind it for good."""
    from gyre_hpc.rundir.metrics import read_table
    try:
        tl = read_table(run_dir / "metrics.h5", "timeline")
        ev = read_table(run_dir / "metrics.h5", "events")
    except (OSError, KeyError):
        return {"event": [], "time": []}
    starts = [t for e, t in zip(ev["event"], ev["time"]) if e in ("fleet_start", "fleet_resume")]
    since = max(starts) if starts else 0.0
    keep = [i for i, t in enumerate(tl["time"]) if t >= since]
    return {"event": [tl["event"][i] for i in keep], "time": [float(tl["time"][i]) for i in keep]}


def open_flip(timeline: dict) -> bool:
    """The latest flip row is a ``flip_start``: a flip under way (the controller writes its
    start rows before the flip's collective and its end rows after)."""
    flips = [e for e in timeline["event"] if e in ("flip_start", "flip_end")]
    return bool(flips) and flips[-1] == "flip_start"


def staging_checkpoint(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    try:
        return any(p.name.endswith(".tmp") for p in root.iterdir())
    except OSError:
        return False


def store_length(run_dir: Path) -> int:
    """Committed trees, from the commit marker alone (cheap enough to poll)."""
    from gyre_hpc.trees.store_commit import marker_path
    try:
        return int(json.loads(marker_path(run_dir / "trees.zarr").read_text())["lengths"]["tree"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def moment_now(run_dir: Path, store_before: int, migrations_before: int) -> str:
    """What the run is doing, from what it has written (the order is the signals' reliability)."""
    if staging_checkpoint(run_dir):
        return "checkpoint"
    tl = _timeline(run_dir)
    if open_flip(tl):
        return "flip"
    if sum(1 for e in tl["event"] if e == "migrate") > migrations_before:
        return "migration"
    if store_length(run_dir) > store_before:
        return "append"
    return "rollout"


# ---- Slurm and processes -------------------------------------------------------------------
def _job_state(job: str) -> str:
    return job_state(job) or "UNKNOWN"


def _fleet_info(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "logs" / "fleet.json").read_text())
    except (OSError, ValueError):
        return {}


def _rank_pids(run_dir: Path) -> list[int]:
    """The fleet's rank processes (python, not srun or the guard) on this host."""
    from gyre_hpc.jobs.ownership import fleet_pids
    pids = []
    for pid, argv in fleet_pids(run_dir):
        if Path(argv[0]).name.startswith("python") and "srun" not in argv[0]:
            pids.append(pid)
    return sorted(pids)


def _head_pid(run_dir: Path) -> int | None:
    try:
        m = re.match(r"pid (\d+)", (run_dir / "head.lock").read_text())
    except OSError:
        return None
    return int(m.group(1)) if m else None


def _submit(run_dir: Path, out: Path, overrides: list[str]) -> str:
    sets = [a for o in (f"run_dir={run_dir}", *SMALL, *overrides) for a in ("--set", o)]
    r = subprocess.run(["sbatch", "--parsable", "-o", str(out), SCRIPT, CONFIG, *sets], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise click.ClickException(f"sbatch failed: {r.stderr.strip()}")
    return r.stdout.strip().split(";")[0]


def _wait(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise click.ClickException(f"timed out after {timeout:.0f} s waiting for {what}")


# ---- the run -----------------------------------------------------------------------------------
def _probe(moment: str, run_dir: Path, store_before: int, migrations_before: int):
    """A cheap test of one moment's signal, polled while a fault waits for it."""
    if moment == "checkpoint":
        return staging_checkpoint(run_dir)
    if moment == "append":
        return store_length(run_dir) > store_before
    tl = _timeline(run_dir)
    if moment == "flip":
        return open_flip(tl)
    return sum(1 for e in tl["event"] if e == "migrate") > migrations_before


def inject(fault: Fault, run_dir: Path, job: str) -> dict:
    """Wait for the fault's moment (or ``MOMENT_WAIT_S``), then land it; what was hit."""
    store_before = store_length(run_dir)
    migrations_before = sum(1 for e in _timeline(run_dir)["event"] if e == "migrate")
    deadline = time.monotonic() + MOMENT_WAIT_S
    while fault.moment != "any" and time.monotonic() < deadline:
        if _probe(fault.moment, run_dir, store_before, migrations_before):
            break
        time.sleep(0.01)
    info = _fleet_info(run_dir)
    landed = False
    if fault.kind == "rank":
        pids = _rank_pids(run_dir)
        if pids:
            victim = random.Random(hash((fault, time.time()))).choice(pids)
            landed = _kill(victim)
    elif fault.kind == "step" and info.get("step_id"):
        landed = subprocess.run(["scancel", str(info["step_id"])], capture_output=True).returncode == 0
    elif fault.kind == "head":
        pid = _head_pid(run_dir)
        landed = pid is not None and _kill(pid)
    # Classified after the kill from what the run had written by then (a staging checkpoint
    # left behind, a flip without its end, a migrate row, a store that grew).
    hit = moment_now(run_dir, store_before, migrations_before)
    return {"kind": fault.kind, "moment": fault.moment, "hit": hit, "landed": landed,
            "launch": info.get("launch"), "time": time.time()}


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def run_chaos(run_dir: Path, steps: int, faults: list[Fault], timeout_s: float) -> dict:
    out_dir = run_dir.parent
    overrides = [f"train.steps={steps}", "supervise.max_relaunches=1000", "supervise.head_lease_s=10"]
    t0 = time.monotonic()
    submissions = [_submit(run_dir, out_dir / "head-1.out", overrides)]
    injected: list[dict] = []
    last_launch = None
    error = None
    try:
        for fault in faults:
            job = submissions[-1]
            if _job_state(job) in ENDED_STATES:
                break          # the run finished before the schedule did

            def running(seen=last_launch) -> dict | None:
                """The fleet this fault hits: the first one seen running after the previous fault."""
                info = _fleet_info(run_dir)
                if not info.get("step_id") or (seen is not None and info.get("launch") == seen):
                    return None
                return info if _rank_pids(run_dir) else None
            launch = _wait(running, 600, "a running fleet")
            last_launch = launch.get("launch")
            time.sleep(fault.delay_s)
            if _job_state(job) in ENDED_STATES:
                break
            injected.append(inject(fault, run_dir, job))
            if fault.kind == "head" and injected[-1]["landed"]:
                _wait(lambda: _job_state(job) in ENDED_STATES, 300, f"job {job} to end after its head died")
                # The fleet's lease runs out (supervise.head_lease_s): it checkpoints and exits.
                from gyre_hpc.jobs.ownership import live_fleet, reap_stray_sruns
                from gyre_hpc.rundir.layout import RunDir
                # What the next head checks first (a stray srun client is reaped, live ranks refuse it).
                _wait(lambda: not reap_stray_sruns(RunDir.at(run_dir)) and not live_fleet(RunDir.at(run_dir)), 300,
                      "the dead head's fleet to end", poll=1.0)
                submissions.append(_submit(run_dir, out_dir / f"head-{len(submissions) + 1}.out", overrides))
                last_launch = None
            if time.monotonic() - t0 > timeout_s:
                break
        job = submissions[-1]
        _wait(lambda: _job_state(job) in ENDED_STATES, max(60.0, timeout_s - (time.monotonic() - t0)),
              f"job {job} to finish", poll=1.0)
    except Exception as exc:
        # A wait that timed out (a loaded machine, a fleet that never came up), or the bench's
        # own probe failing on what a killed run left: the report still says what happened
        # (--json prints it), and no job of this run is left holding the cluster's nodes.
        error = exc.message if isinstance(exc, click.ClickException) else f"{type(exc).__name__}: {exc}"
        for submitted in submissions:
            subprocess.run(["scancel", submitted], capture_output=True)
        job = submissions[-1]
    return {"submissions": submissions, "final_state": _job_state(job), "injected": injected,
            "wall_s": round(time.monotonic() - t0, 1), "error": error}


def audit(run_dir: Path, steps: int, per_step: int, snapshot_every: int) -> dict:
    """Exactly-once counts and the final state's readability."""
    from gyre_hpc.cells import checkpoint
    from gyre_hpc.models.checkpoint import load_pretrained
    from gyre_hpc.rundir.load import open_trees
    from gyre_hpc.rundir.metrics import read_table
    from gyre_hpc.trees.store import TreeStore

    with TreeStore.open(run_dir / "trees.zarr", "r") as store:
        ids = store.run_ids()
    want = {f"s{s:05d}-" for s in range(1, steps + 1)}
    by_step = Counter(rid.split("-", 1)[0] + "-" for rid in ids)
    step_rows = [int(s) for s in read_table(run_dir / "metrics.h5", "steps")["step"]]
    runs = read_table(run_dir / "metrics.h5", "runs")
    events = read_table(run_dir / "metrics.h5", "events")
    ds = open_trees(run_dir / "trees.zarr")
    latest = checkpoint.latest_dir(run_dir / "checkpoints")
    meta = checkpoint.read_meta(latest) if latest is not None else None
    loadable = False
    if latest is not None:
        load_pretrained(latest)
        loadable = True
    names = list(events["event"])
    return {
        "trees": len(ids), "trees_expected": steps * per_step,
        "trees_duplicated": len(ids) - len(set(ids)),
        "trees_lost": steps * per_step - len(set(ids)),
        "trees_per_step_ok": set(by_step) == want and all(n == per_step for n in by_step.values()),
        "xarray_trees": int(ds.sizes.get("tree", 0)),
        "step_rows": len(step_rows), "step_rows_once": sorted(step_rows) == list(range(1, steps + 1)),
        "run_rows": int(len(runs["run_id"])), "run_rows_once": len(set(runs["run_id"])) == len(runs["run_id"]) == steps * per_step,
        "final_checkpoint_step": meta.step if meta else None, "final_checkpoint_loads": loadable,
        "relaunches": names.count("relaunch"),
        "fleet_launches": sum(1 for e in names if e in ("fleet_start", "fleet_resume")),
        "steps_redone": steps_redone(list(zip(events["event"], (int(s) for s in events["step"])))),
        **resume_counts(runs, snapshot_every),
    }


def resume_counts(runs: dict, snapshot_every: int) -> dict:
    """Resume, not restart, from the ``runs`` table's columns: the runs a relaunch found with
    calls in their journal (``resumed_calls`` > 0, or ``restarted_from_first``), the calls each
    made again (``tools_redone``; no journaled call goes to the engine again) against the
    snapshot interval, and the runs that began again at their first call. A run resumed more
    than once has the counts of its last resume (its row is written once)."""
    missing = [c for c in ("resumed_calls", "tools_redone", "restarted_from_first", "calls") if c not in runs]
    if missing:
        raise KeyError(f"metrics.h5 runs table has no column {missing[0]!r} (written before issue 53)")
    resumed = [i for i in range(len(runs["run_id"])) if runs["resumed_calls"][i] > 0 or runs["restarted_from_first"][i]]
    redone = [int(runs["tools_redone"][i]) for i in resumed]
    calls = [int(c) for c in runs["calls"]]
    return {
        "snapshot_every": snapshot_every,
        "calls_per_run_mean": round(sum(calls) / len(calls), 2) if calls else 0.0,
        "interrupted_runs": len(resumed),
        "resumed_calls_per_interrupted_run_mean": round(sum(int(runs["resumed_calls"][i]) for i in resumed) / len(resumed), 2)
        if resumed else 0.0,
        "calls_redone_per_interrupted_run_max": max(redone, default=0),
        "calls_redone_per_interrupted_run_mean": round(sum(redone) / len(redone), 2) if redone else 0.0,
        "calls_redone_within_snapshot_interval": all(r <= snapshot_every for r in redone),
        "runs_restarted_from_first_call": sum(int(runs["restarted_from_first"][i]) for i in resumed),
    }


def snapshot_every() -> int:
    """The run's ``rollout.snapshot_every``: the config's, as the bench submits it."""
    from gyre_hpc.config import load_config
    return load_config(REPO / CONFIG, overrides=list(SMALL)).rollout.snapshot_every


def steps_redone(events: list[tuple[str, int]]) -> int:
    """Steps whose training was begun again: each fleet launch (``fleet_start``/``fleet_resume``)
    counts the steps it trained a micro-batch of (``train_mb``); beyond the distinct steps,
    the rest were redone (completed past the last checkpoint, or cut off mid-step)."""
    per_launch: list[set[int]] = []
    for event, step in events:
        if event in ("fleet_start", "fleet_resume"):
            per_launch.append(set())
        elif event == "train_mb" and per_launch:
            per_launch[-1].add(step)
    return sum(len(s) for s in per_launch) - len(set().union(*per_launch)) if per_launch else 0


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--faults", "n_faults", default=20, show_default=True, help="faults to inject")
@click.option("--steps", default=80, show_default=True, help="RL steps of the run: enough that every fault lands before the last (with one-call runs a step took 1-2 s and 40 steps ended after 9 of 20 faults; with the long suite's runs a step takes 12-39 s on a 2-core machine at load ~16, so 80, not 200)")
@click.option("--seed", default=0, show_default=True, help="the fault schedule's seed")
@click.option("--timeout-s", default=3600.0, show_default=True, help="give up after this long")
@click.option("--keep", type=click.Path(file_okay=False), default=None, help="run directory to keep (default: a temporary one)")
def command(as_json: bool, n_faults: int, steps: int, seed: int, timeout_s: float, keep: str | None) -> None:
    """SIGKILL ranks, scancel the fleet step and SIGKILL the head of a Slurm RL run; count what survived."""
    if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
        raise click.ClickException("the local Slurm cluster is not up: gyre-hpc cluster up")
    faults = fault_schedule(seed, n_faults)
    with tempfile.TemporaryDirectory(prefix="gyre-chaos-") as tmp:
        run_dir = Path(keep).resolve() if keep else Path(tmp) / "run"
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        got = run_chaos(run_dir, steps, faults, timeout_s)
        per_step = 2 * 4      # the config's tasks_per_step x SMALL's runs_per_task
        result = {"seed": seed, "steps": steps, "faults_scheduled": len(faults),
                  "faults_injected": sum(1 for f in got["injected"] if f["landed"]),
                  "by_kind": dict(Counter(f["kind"] for f in got["injected"] if f["landed"])),
                  "moments_targeted": dict(Counter(f["moment"] for f in got["injected"] if f["landed"])),
                  "moments_hit": dict(Counter(f["hit"] for f in got["injected"] if f["landed"])),
                  "head_submissions": len(got["submissions"]), "final_job_state": got["final_state"],
                  "wall_s": got["wall_s"], "error": got["error"], "faults": [asdict(f) for f in faults], "injected": got["injected"]}
        try:
            result.update(audit(run_dir, steps, per_step, snapshot_every()) if (run_dir / "trees.zarr").exists() else {"audit": "no store"})
        except Exception as exc:   # a run cut short can leave what the audit reads half there: say so in the JSON
            result["audit"] = f"failed: {exc!r}"
        result["ok"] = bool(got["error"] is None and result["faults_injected"] == len(faults) and got["final_state"] == "COMPLETED"
                            and result.get("trees_lost") == 0 and result.get("trees_duplicated") == 0
                            and result.get("step_rows_once") and result.get("run_rows_once")
                            and result.get("final_checkpoint_step") == steps and result.get("final_checkpoint_loads")
                            and result.get("runs_restarted_from_first_call") == 0
                            and result.get("calls_redone_within_snapshot_interval"))
    emit(result, as_json)
    if not result["ok"]:
        sys.exit(1)

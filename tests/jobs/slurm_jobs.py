"""Polling helpers for tests that drive real Slurm jobs (no sacct here: scontrol only)."""
from __future__ import annotations

import json
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path

from gyre_hpc.rundir.metrics import read_table

REPO = Path(__file__).resolve().parents[2]
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def sbatch(*args: str, cwd: Path = REPO) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    """The het leader's (or plain job's) fields from ``scontrol show job -o``."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    line = out.stdout.splitlines()[0]
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line))


_nudged: dict[str, float] = {}


def nudge_if_eligible(job_id: str, info: dict[str, str]) -> bool:
    """Touch a pending job whose begin time has passed, so the backfill scheduler looks at it.

    A requeued job is held until ``EligibleTime`` (``cred_expire`` + 1 s), and Slurm's backfill
    runs only after some job, node or partition changed; the begin time passing is no such
    change. On a busy cluster something always changes; on this idle test cluster the
    requeued head waited 24-171 s past its eligibility for an unrelated event (slurmctld.log,
    2026-12-07). A comment update is a job change: it restarted 1 s after eligibility.
    Returns whether it nudged (at most once every 2 s per job)."""
    eligible = info.get("EligibleTime", "")
    if info.get("JobState") != "PENDING" or not eligible[:1].isdigit():
        return False
    if datetime.fromisoformat(eligible) > datetime.now() or time.monotonic() - _nudged.get(job_id, 0.0) < 2.0:
        return False
    _nudged[job_id] = time.monotonic()
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"Comment=test-nudge-{time.time():.0f}"],
                   capture_output=True, timeout=20)
    return True


def wait_job(job_id: str, timeout: float, until=lambda info: info["JobState"] in DONE_STATES, log: Path | None = None) -> dict:
    deadline = time.monotonic() + timeout
    info = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if until(info):
            return info
        nudge_if_eligible(job_id, info)
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s\n{tail}")


def wait_for(predicate, timeout: float, what: str, job_id: str | None = None, log: Path | None = None,
             ended_for_s: float = 10.0):
    """Poll ``predicate``; fail early once the job has been in a final state for ``ended_for_s``
    (a requeued het job can show a final state for a moment while Slurm requeues it: seen in
    CI after the third requeue of the time-limit test)."""
    deadline = time.monotonic() + timeout
    ended_since = None
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        info = job_info(job_id) if job_id is not None else {}
        if job_id is not None:
            nudge_if_eligible(job_id, info)
        if info.get("JobState") in DONE_STATES:
            ended_since = ended_since if ended_since is not None else time.monotonic()
            if time.monotonic() - ended_since >= ended_for_s:
                tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
                raise AssertionError(f"job {job_id} ended while waiting for {what}\n{tail}")
        else:
            ended_since = None
        time.sleep(0.2)
    state = ""
    if job_id:
        info = job_info(job_id)
        state = f" (job {job_id}: {info.get('JobState')}, reason {info.get('Reason')}, restarts {info.get('Restarts')})"
        subprocess.run(["scancel", job_id])
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{state}")


def checkpoint_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    if not latest.is_file():
        return 0
    meta = run_dir / "checkpoints" / latest.read_text().strip() / "meta.json"
    try:
        return json.loads(meta.read_text())["step"]
    except (OSError, ValueError):
        return 0


def fleet_step(run_dir: Path, launch: int) -> str | None:
    """The Slurm step id of fleet launch number ``launch`` once the supervisor has seen it."""
    p = run_dir / "logs" / "fleet.json"
    try:
        info = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return info["step_id"] if info["launch"] == launch else None


def events(run_dir: Path) -> list[tuple[str, int, str]]:
    t = read_table(run_dir / "metrics.h5", "events")
    return list(zip(t["event"], (int(s) for s in t["step"]), t["detail"]))


def steps(run_dir: Path) -> list[int]:
    return [int(s) for s in read_table(run_dir / "metrics.h5", "steps")["step"]]


def flips(run_dir: Path) -> dict[int, list[str]]:
    """Per cell, the roles it completed flips into, in order."""
    t = read_table(run_dir / "metrics.h5", "timeline")
    out: dict[int, list[str]] = {}
    for cell, role, event in zip(t["cell"], t["role"], t["event"]):
        if event == "flip_end":
            out.setdefault(int(cell), []).append(role)
    return out


def evidence(run_dir: Path, lines: int = 15) -> str:
    """Events plus the tail of every fleet log: what a failed assertion should show."""
    parts = []
    try:
        parts.append("events: " + "; ".join(f"{e}@{s} {d}" for e, s, d in events(run_dir)))
    except Exception as exc:  # noqa: BLE001 - evidence must not hide the real failure
        parts.append(f"events unreadable: {exc}")
    for log in sorted((run_dir / "logs").glob("fleet-*.log")):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        parts.append(f"--- {log.name}\n{tail}")
    return "\n".join(parts)

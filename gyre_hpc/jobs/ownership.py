"""Who owns a run directory: one head at a time, no fleet of an earlier head still running,
and no silent change of what the directory's results mean.

Why each check:
- ``HeadLock``: two heads on one directory (a rerun while the first runs, a requeued job
  next to a manual rerun) would each launch a fleet, and two writers corrupt ``metrics.h5``
  and mix two runs' trees. An ``flock`` held for the head's life, released by the kernel
  however the head dies (so a stale lock file is never a problem), names its holder;
- ``live_fleet``: the lock dies with a SIGKILLed head, its fleet may not (a Slurm step, a
  local fleet still tearing down). A new head "recovering" ``metrics.h5`` under live ranks
  loses their rows, so it refuses while any process of this directory's fleet lives (after
  ``reap_stray_sruns``: an srun client whose step Slurm has ended runs nothing);
- ``config_changes``: a directory holds one run. Resuming with another suite or lr mixes
  two experiments in one store without a trace; only changes a resume is meant to allow
  (more steps, how it is supervised and where it runs) pass.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre_hpc import fsio
from gyre_hpc.config import WORKLOADS, RunConfig
from gyre_hpc.rundir.layout import CHECKPOINT_LATEST, RunDir

# What a resume may change: sections that say how and where the run is carried out, not what it
# computes; and ``train.steps`` upwards (checked separately).
REAP_WAIT_S = 5.0   # how long reaping waits for a SIGKILLed srun to be gone
RESUMABLE_PREFIXES = ("supervise.", "slurm.", "metrics.", "launcher", "name")


class RunDirInUse(RuntimeError):
    """The run directory belongs to a live head or fleet, or holds a run of another config."""


@dataclass
class HeadLock:
    """An exclusive ``flock`` on ``<run>/head.lock`` for the life of this head."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, run: RunDir) -> "HeadLock":
        run.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(run.head_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 512).decode(errors="replace").strip() or "a head that wrote nothing yet"
            os.close(fd)
            raise RunDirInUse(f"run directory {run.root} is in use by another head ({holder}); "
                              f"wait for it, stop it, or use --set run_dir=<another directory>") from None
        os.ftruncate(fd, 0)
        try:
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        except OSError as exc:
            # The lock holds without the line; the supervisor's first write reports the full disk.
            if not fsio.is_disk_full(exc):
                os.close(fd)
                raise
        return cls(run.head_lock, fd)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return None if state == "Z" or not raw else raw.rstrip(b"\0").decode(errors="replace").split("\0")


def _is_fleet_of(argv: list[str], root: str) -> bool:
    fleets = [list(entry.fleet) for entry in WORKLOADS.values()]   # every workload's (-m gyre_hpc.rl)
    starts_a_fleet = any(argv[i:i + len(f)] == f for f in fleets for i in range(len(argv)))
    for i, arg in enumerate(argv[:-1]):
        if arg == "--run-dir" and os.path.realpath(argv[i + 1]) == root and starts_a_fleet:
            return True
    return False


def fleet_pids(run_dir: str | Path) -> list[tuple[int, list[str]]]:
    """This host's processes of the directory's fleet (launcher, guard, ranks), with their argv."""
    root = os.path.realpath(run_dir)
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            argv = _cmdline(int(entry))
            if argv and _is_fleet_of(argv, root):
                found.append((int(entry), argv))
    return found


def _recorded_step(run: RunDir) -> str | None:
    try:
        return json.loads((run.logs / "fleet.json").read_text()).get("step_id")
    except (OSError, ValueError):
        return None


def _step_listed(step: str) -> bool:
    try:
        out = subprocess.run(["scontrol", "show", "step", str(step)], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and f"StepId={step}" in out.stdout


def reap_stray_sruns(run: RunDir) -> list[str]:
    """SIGKILL this directory's ``srun`` clients once Slurm no longer lists the step they
    launched; what was killed. Seen (bench chaos): a head SIGKILLed inside its batch job, the
    job ended and its step with it, and the srun client stayed behind for good, hung in its
    teardown with nothing under it, so every rerun was refused for a fleet that was gone.
    A live step keeps its srun; the ranks themselves are never touched here."""
    step = _recorded_step(run)
    if step is not None and _step_listed(step):
        return []
    reaped, killed = [], []
    for pid, argv in fleet_pids(run.root):
        if Path(argv[0]).name == "srun":
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
            reaped.append(f"pid {pid} (srun of ended step {step})")
    # SIGKILL is not death: a just-killed srun stays in /proc until the kernel has taken it
    # down, and the caller's next look (``live_fleet``) would refuse the rerun for it
    # (docs/jobs.md, "Measurements"). Wait until they are gone.
    deadline = time.monotonic() + REAP_WAIT_S
    while killed and time.monotonic() < deadline:
        killed = [pid for pid in killed if _alive(pid)]
        if killed:
            time.sleep(0.05)
    return reaped


def _alive(pid: int) -> bool:
    """Running, not a zombie (a zombie's argv is empty, so ``fleet_pids`` no longer lists it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def live_fleet(run: RunDir) -> list[str]:
    """What still runs of this directory's fleet: local processes (launcher, guard, ranks) by
    pid, and the Slurm step the last head recorded, if Slurm still lists it."""
    found = [f"pid {pid} ({' '.join(argv)[:120]})" for pid, argv in fleet_pids(run.root)]
    step = _recorded_step(run)
    if step and _step_listed(step):
        found.append(f"Slurm step {step}")
    return found


def has_results(run: RunDir) -> bool:
    """A checkpoint or a tree store: something a different config would mix with."""
    return (run.checkpoints / CHECKPOINT_LATEST).exists() or run.trees.exists()


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "elastic":
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(stored: RunConfig, new: RunConfig) -> list[str]:
    """The changed fields a resume does not allow, as ``field: old -> new``; empty when fine."""
    old_f = _flat(stored.model_dump(mode="json"))
    new_f = _flat(new.model_dump(mode="json"))
    refused = []
    for key in sorted(set(old_f) | set(new_f)):
        a, b = old_f.get(key), new_f.get(key)
        if a == b or key == "run_dir" or key.startswith(RESUMABLE_PREFIXES):
            continue
        if key == "train.steps" and isinstance(a, int) and isinstance(b, int) and b >= a:
            continue
        refused.append(f"{key}: {a!r} -> {b!r}")
    return refused


def check_rerun(run: RunDir, cfg: RunConfig, stored: RunConfig | None) -> None:
    """Refuse a start whose config changes what the directory's results mean."""
    if stored is None or not has_results(run):
        return
    changed = config_changes(stored, cfg)
    if changed:
        raise RunDirInUse(
            f"run directory {run.root} holds a run with another config; changed: {'; '.join(changed)}. "
            f"A resume may only raise train.steps or change supervise.*, slurm.*, metrics.*, launcher, name; "
            f"start a new run with --set run_dir=<new directory>")

"""A run directory on a small file system that fills mid-run (issue 26, item 3).

Each test mounts a tmpfs of a few MiB, points ``run_dir`` into it and runs the real command
(``gyre-hpc run`` on the local launcher; ``sbatch sbatch/gyre_head.sh`` on the local Slurm
cluster). The run must stop at once (no relaunch loop) naming the file and the space, keep
every committed tree, row and checkpoint readable, and, once the file system is made larger,
finish from the same command with every step, run and tree exactly once.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre_hpc.cells import checkpoint
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import read_table
from gyre_hpc.trees.store import TreeStore
from tests.jobs.slurm_jobs import REPO, checkpoint_step, events, evidence, sbatch, steps, wait_job

SMALL_MB = 4     # fills during the second (rl) or third (smoke, 1 MiB state) checkpoint
LARGER_MB = 64   # what "space is freed" means here: the file system grown
CLI = [sys.executable, "-c", "from gyre_hpc.cli import main; main()"]


@dataclass
class SmallDisk:
    path: Path

    def resize(self, mb: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={mb}M", str(self.path)], check=True)


def _users_of(mount: Path) -> list[int]:
    """Pids with a cwd or an open file on ``mount`` (what would make umount fail: busy)."""
    pids = []
    prefix = str(mount) + "/"
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        links = [f"/proc/{entry}/cwd"]
        try:
            links += [f"/proc/{entry}/fd/{fd}" for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        for link in links:
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target == str(mount) or target.startswith(prefix):
                pids.append(int(entry))
                break
    return pids


def _release(mount: Path) -> None:
    """Kill what still uses the mount (only this test's processes can), then unmount it."""
    for _ in range(20):
        if not os.path.ismount(mount):
            return
        for pid in _users_of(mount):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    subprocess.run(["umount", "-l", str(mount)], check=True)   # detached now, freed when unused


@pytest.fixture
def small_disk(tmp_path):
    if shutil.which("mount") is None:
        pytest.skip("`mount` is not on PATH: the full-disk tests mount a small tmpfs")
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_MB}M", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"mounting a {SMALL_MB} MiB tmpfs needs CAP_SYS_ADMIN (root outside a locked-down "
                    f"container): mount said {out.stderr.strip()!r}")
    try:
        yield SmallDisk(mnt)
    finally:
        _release(mnt)


def _assert_stopped_for_disk_full(text: str, run_dir: Path) -> None:
    assert f"No space left on device writing {run_dir}/" in text, text[-3000:]
    assert f"MiB free of {SMALL_MB}.0 MiB" in text, text[-3000:]
    assert "free space there and run the same command again" in text, text[-3000:]


def _committed_ids(run: RunDir) -> list[str]:
    with TreeStore.open(run.trees, "r") as store:
        assert store.verify().chunks > 0      # raises naming any bad chunk
        return store.run_ids()


@pytest.mark.mpi
@pytest.mark.slow
def test_full_disk_stops_the_local_run_and_the_same_command_resumes_it(tmp_path, small_disk):
    """workload rl (trees, journals, run rows, checkpoints), local launcher, 4 steps of 8 runs."""
    run = RunDir.at(small_disk.path / "run")
    config = tmp_path / "run.yaml"    # off the small disk, like a user's config
    config.write_text(f"run_dir: {run.root}\nlauncher: local\nworkload: rl\nseed: 0\n"
                      "rollout: {tasks: easy, runs_per_task: 4, tasks_per_step: 2, max_new_tokens: 24}\n"
                      "train: {steps: 4, lr: 0.02}\nsupervise: {poll_s: 0.2}\n")
    command = CLI + ["run", str(config)]
    first = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=240)
    text = first.stdout + first.stderr
    assert first.returncode == 1, text[-3000:]
    _assert_stopped_for_disk_full(text, run.root)
    names = [e for e, _, _ in events(run.root)]
    assert "relaunch" not in names and names.count("launch") == 1, evidence(run.root)

    # Nothing committed is lost: the latest checkpoint loads, its steps' rows and trees are there.
    saved = checkpoint_step(run.root)
    assert 1 <= saved < 4, evidence(run.root)
    latest = checkpoint.latest_dir(run.checkpoints)
    assert checkpoint.read_meta(latest).step == saved
    assert checkpoint.load_state(latest)                       # model.safetensors reads back
    assert steps(run.root) == list(range(1, saved + 1))
    before = _committed_ids(run)
    assert len(before) >= 8 * saved and len(set(before)) == len(before)

    small_disk.resize(LARGER_MB)
    second = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:] + evidence(run.root)
    assert f"resuming after step {saved}" in second.stdout
    assert steps(run.root) == [1, 2, 3, 4]
    runs = read_table(run.metrics, "runs")
    assert sorted(Counter(runs["step"].tolist()).items()) == [(s, 8) for s in range(1, 5)]
    assert len(set(runs["run_id"].tolist())) == len(runs["run_id"]) == 32
    ids = _committed_ids(run)
    assert len(ids) == 32 and len(set(ids)) == 32 and ids[:len(before)] == before
    assert checkpoint.read_meta(checkpoint.latest_dir(run.checkpoints)).extra["trained_upto"] == 32
    assert not run.disk_full.exists()


def test_a_head_started_on_a_full_disk_refuses_before_launching(tmp_path, small_disk):
    """Still full (the user reran before freeing space): said at once, no fleet started."""
    ballast = small_disk.path / "ballast"
    with open(ballast, "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
    run_dir = small_disk.path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"run_dir: {run_dir}\nlauncher: local\ncells: {{count: 1}}\n")
    out = subprocess.run(CLI + ["run", str(config)], capture_output=True, text=True, cwd=REPO, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "disk full, before launching the fleet" in text and f"No space left on device writing {run_dir}/" in text
    assert not list((run_dir / "logs").glob("fleet-*.log"))


@pytest.mark.slurm
@pytest.mark.slow
def test_full_disk_fails_the_slurm_job_once_and_a_resubmission_finishes(tmp_path, small_disk):
    """sbatch het job (smoke, 1 MiB state): one FAILED job naming the file, no relaunch; after
    the file system grows, the same sbatch resumes and runs steps 1..8 exactly once."""
    run_dir = small_disk.path / "run"
    sets = [a for o in (f"run_dir={run_dir}", "train.steps=8", "model.substrate_state_mb=1", "supervise.poll_s=0.2")
            for a in ("--set", o)]
    out = tmp_path / "head-1.out"
    job = sbatch("-o", str(out), "sbatch/gyre_head.sh", "examples/smoke.yaml", *sets)
    try:
        info = wait_job(job, 150, log=out)
    finally:
        subprocess.run(["scancel", job])    # a no-op once it ended; frees the mount if it did not
    text = out.read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", text[-3000:]
    _assert_stopped_for_disk_full(text, run_dir)
    names = [e for e, _, _ in events(run_dir)]
    assert "relaunch" not in names and names.count("launch") == 1, evidence(run_dir)
    saved = checkpoint_step(run_dir)
    assert 1 <= saved < 8, evidence(run_dir)
    assert checkpoint.load_state(checkpoint.latest_dir(run_dir / "checkpoints"))
    assert steps(run_dir) == list(range(1, saved + 1))
    report = json.loads((run_dir / "control" / "disk-full.json").read_text())
    assert "No space left on device writing" in report["message"]

    small_disk.resize(LARGER_MB)
    out2 = tmp_path / "head-2.out"
    job2 = sbatch("-o", str(out2), "sbatch/gyre_head.sh", "examples/smoke.yaml", *sets)
    try:
        info = wait_job(job2, 150, log=out2)
    finally:
        subprocess.run(["scancel", job2])
    assert info["JobState"] == "COMPLETED", out2.read_text()[-3000:] + evidence(run_dir)
    assert f"resuming after step {saved}" in out2.read_text()
    counts = Counter(steps(run_dir))
    assert sorted(counts) == list(range(1, 9)) and set(counts.values()) == {1}
    assert checkpoint.read_meta(checkpoint.latest_dir(run_dir / "checkpoints")).step == 8

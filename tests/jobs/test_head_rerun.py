"""SIGKILL the head mid-run and rerun the same command at once: the orphaned fleet must not
live on under the new head, and the run must end with every step and run row."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from gyre_hpc.jobs.ownership import live_fleet
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import read_table
from gyre_hpc.trees.store import TreeStore

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.slow]

CONFIG = """\
workload: rl
run_dir: {run}
seed: 0
cells: {{count: 2}}
rollout: {{tasks: easy, runs_per_task: 4, tasks_per_step: 2, max_new_tokens: 24}}
train: {{steps: 12, lr: 0.02}}
supervise: {{poll_s: 0.2}}
"""


def _head(cfg: Path, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "gyre_hpc.jobs.head", str(cfg)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkill_the_head_and_rerun_at_once_loses_no_step_or_run_row(tmp_path):
    run = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.format(run=run))
    first = _head(cfg)
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "latest").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
        time.sleep(0.2)
    old_fleet = live_fleet(RunDir.at(run))
    assert old_fleet, "no fleet process found to orphan"
    first.send_signal(signal.SIGKILL)
    first.wait()
    old_pids = [int(f.split()[1]) for f in old_fleet if f.startswith("pid ")]
    # at once: while the old fleet tears down this start is refused naming it, never run over it
    again = _head(cfg)
    deadline = time.monotonic() + 12          # the guard's grace is 5 s
    while [p for p in old_pids if _alive(p)]:
        assert time.monotonic() < deadline, f"the killed head's fleet lives on: {[p for p in old_pids if _alive(p)]}"
        time.sleep(0.2)
    out, _ = again.communicate(timeout=900)
    refusals = 0
    while again.returncode == 2:
        assert "still running" in out and "pid " in out, out
        refusals += 1
        assert refusals < 30, out
        time.sleep(0.5)
        again = _head(cfg)
        out, _ = again.communicate(timeout=900)
    assert again.returncode == 0, out
    steps = read_table(run / "metrics.h5", "steps")["step"].tolist()
    assert sorted(Counter(steps).items()) == [(s, 1) for s in range(1, 13)], steps
    with TreeStore.open(run / "trees.zarr", "r") as store:
        ids = store.run_ids()
    assert len(ids) == 12 * 8 and len(set(ids)) == len(ids)
    run_rows = read_table(run / "metrics.h5", "runs")["run_id"].tolist()
    assert set(run_rows) == set(ids), (len(run_rows), len(ids))     # no run row lost

"""The supervisor on the local launcher: relaunch, give up, drain, requeue, resume (real MPI ranks)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from gyre_hpc.config import build_config, load_config
from gyre_hpc.jobs.launchers import LocalLauncher
from gyre_hpc.jobs.plan import local_plan
from gyre_hpc.jobs.supervisor import Supervisor
from gyre_hpc.rundir.layout import RunDir
from tests.jobs.slurm_jobs import REPO, checkpoint_step, events, steps

PROBE = str(Path(__file__).with_name("mpi_probe.py"))


def _sup(tmp_path, cfg, argv=None, **kw) -> Supervisor:
    run = RunDir.at(tmp_path / "run")
    return Supervisor(cfg=cfg, run=run, launcher=LocalLauncher(), plan=local_plan(cfg), argv=argv,
                      log=lambda m: None, **kw)


def _names(run_dir) -> list[str]:
    return [e for e, _, _ in events(run_dir)]


def test_prepare_writes_the_resolved_config_and_clears_a_stale_stop(tmp_path):
    cfg = build_config({"run_dir": "relative/run", "cells": {"count": 2}})
    sup = _sup(tmp_path, cfg)
    sup.run.make()
    sup.run.exit_request.touch()
    sup.prepare()
    written = load_config(sup.run.config)
    assert written.run_dir == str(sup.run.root) and Path(written.run_dir).is_absolute()
    assert written.cells.count == 2
    assert not sup.run.exit_request.exists()


@pytest.mark.mpi
def test_failing_fleet_is_relaunched_then_the_run_fails_naming_the_limit(tmp_path):
    cfg = build_config({"cells": {"count": 1}, "supervise": {"max_relaunches": 2, "poll_s": 0.1}})
    sup = _sup(tmp_path, cfg, argv=[sys.executable, PROBE, str(tmp_path / "probe"), "--exit-code", "3"])
    result = sup.run_fleet()
    assert result.status == "failed" and result.exit_code == 1 and result.launches == 3
    assert "fleet failed 3 times, more than supervise.max_relaunches=2" in result.message
    assert "exit 3" in result.message and ".log" in result.message
    assert _names(sup.run.root) == ["launch", "exit", "relaunch", "exit", "relaunch", "exit", "fail"]


@pytest.mark.mpi
def test_drain_kills_a_fleet_that_never_checkpoints(tmp_path):
    """submitit calls checkpoint() from its signal handler, inside the supervisor's loop: same here."""
    cfg = build_config({"cells": {"count": 1}, "supervise": {"poll_s": 0.1}})
    out = tmp_path / "probe"
    sup = _sup(tmp_path, cfg, argv=[sys.executable, PROBE, str(out), "--sleep", "300"], drain_timeout_s=1.0)
    drained = []
    old = signal.signal(signal.SIGUSR1, lambda s, f: drained.append(sup.drain("test", requeue=True)))

    def poke():
        deadline = time.monotonic() + 60
        while len(list(out.glob("sleeping-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=poke, daemon=True).start()
    try:
        result = sup.run_fleet()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert drained and drained[0] != 0            # killed after the drain timeout
    assert sup.run.exit_request.exists()
    assert result.status == "stopped" and result.exit_code == 75  # no requeue function outside Slurm
    assert _names(sup.run.root) == ["launch", "requeue", "exit"]


@pytest.mark.mpi
@pytest.mark.slow
def test_stop_request_checkpoints_the_real_fleet_requeues_and_the_next_start_resumes(tmp_path):
    cfg = load_config(REPO / "examples/smoke.yaml", ["launcher=local", "train.steps=12", "model.substrate_state_mb=1",
                                                     "supervise.poll_s=0.1"])
    requeued = []
    sup = _sup(tmp_path, cfg, requeue=lambda: requeued.append(True))

    def stop_after_first_checkpoint():
        deadline = time.monotonic() + 120
        while checkpoint_step(sup.run.root) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        sup.request_stop("test", requeue=True)

    threading.Thread(target=stop_after_first_checkpoint, daemon=True).start()
    first = sup.run_fleet()
    assert first.status == "requeued" and requeued == [True]
    saved = checkpoint_step(sup.run.root)
    assert first.last_step == saved and 1 <= saved < 12

    second = _sup(tmp_path, cfg).run_fleet()
    assert second.status == "finished" and second.last_step == 12
    ev = events(sup.run.root)
    assert [s for e, s, _ in ev if e == "requeue"] == [saved]
    assert [s for e, s, _ in ev if e == "resume"] == [saved]
    assert [s for e, s, _ in ev if e == "fleet_resume"] == [saved + 1]
    counts = Counter(steps(sup.run.root))
    assert sorted(counts) == list(range(1, 13)) and set(counts.values()) == {1}
    assert not sup.run.exit_request.exists()


def test_controllers_recorded_exit_wins_over_a_garbled_srun_code(tmp_path):
    from gyre_hpc.rundir.metrics import MetricsWriter

    cfg = build_config({"cells": {"count": 1}})
    sup = _sup(tmp_path, cfg)
    sup.run.make()
    launched = time.time()
    with MetricsWriter(sup.run.metrics) as w:
        w.event("fleet_exit", 3, "exit 75")
    assert sup._reconcile_exit(143, launched - 1) == 75      # this launch's controller said 75
    assert sup._reconcile_exit(143, launched + 60) == 143    # a record from an earlier launch does not count
    assert sup._reconcile_exit(0, launched - 1) == 0
    with MetricsWriter(sup.run.metrics) as w:
        w.event("fleet_exit", 3, "exit 1")
    assert sup._reconcile_exit(143, launched - 1) == 143     # a failure stays a failure


def test_unreadable_metrics_file_is_kept_aside_not_overwritten(tmp_path):
    cfg = build_config({"cells": {"count": 1}})
    sup = _sup(tmp_path, cfg)
    sup.run.make()
    sup.run.metrics.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)  # a torn file
    sup.event("launch", -1, "attempt 1")
    aside = list(sup.run.root.glob("metrics.h5.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"\x89HDF")
    assert _names(sup.run.root) == ["launch"]

"""One head per run directory: the lock, the live-fleet check, the changed-config check."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gyre_hpc.config import build_config
from gyre_hpc.jobs.launchers import LocalLauncher
from gyre_hpc.jobs.ownership import HeadLock, RunDirInUse, check_rerun, config_changes, live_fleet
from gyre_hpc.jobs.plan import local_plan
from gyre_hpc.jobs.supervisor import Supervisor
from gyre_hpc.rundir.layout import RunDir


def _sup(run: RunDir, cfg) -> Supervisor:
    return Supervisor(cfg=cfg, run=run, launcher=LocalLauncher(), plan=local_plan(cfg),
                      argv=[sys.executable, "-c", "raise SystemExit(0)"], log=lambda m: None)


def test_a_second_head_is_refused_naming_the_first_and_touches_nothing(tmp_path):
    run = RunDir.at(tmp_path / "run")
    cfg = build_config({"run_dir": str(run.root), "cells": {"count": 1}})
    first = HeadLock.acquire(run)
    try:
        result = _sup(run, cfg).run_fleet()
        assert result.status == "refused" and result.exit_code == 2
        assert f"pid {os.getpid()}" in result.message and "in use by another head" in result.message
        assert sorted(p.name for p in run.root.iterdir()) == ["head.lock"]   # no config, no metrics
    finally:
        first.release()
    second = HeadLock.acquire(run)      # released with its holder
    second.release()


def test_a_head_refuses_while_an_earlier_fleet_of_the_directory_lives(tmp_path):
    run = RunDir.at(tmp_path / "run").make()
    cfg = build_config({"run_dir": str(run.root), "cells": {"count": 1}})
    # what a rank of an orphaned fleet looks like in the process table
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "gyre_hpc.cells",
                               "--run-dir", str(run.root)])
    try:
        time.sleep(0.2)
        assert any(f"pid {orphan.pid} " in f for f in live_fleet(run))
        result = _sup(run, cfg).run_fleet()
        assert result.status == "refused" and f"pid {orphan.pid}" in result.message
        assert not run.metrics.exists()
    finally:
        orphan.kill()
        orphan.wait()
    assert live_fleet(run) == []
    other = RunDir.at(tmp_path / "other")
    assert live_fleet(other) == []


def test_a_rerun_with_a_changed_config_is_refused_listing_the_fields(tmp_path):
    run = RunDir.at(tmp_path / "run").make()
    first = build_config({"run_dir": str(run.root), "rollout": {"tasks": "easy"}, "train": {"lr": 0.001, "steps": 4}})
    run.config.write_text(first.to_yaml())
    (run.checkpoints / "latest").write_text("step-000004")
    changed = first.model_copy(update={"rollout": first.rollout.model_copy(update={"tasks": "repo"}),
                                       "train": first.train.model_copy(update={"lr": 0.01})})
    result = _sup(run, changed).run_fleet()
    assert result.status == "refused"
    assert "rollout.tasks: 'easy' -> 'repo'" in result.message and "train.lr: 0.001 -> 0.01" in result.message
    assert "--set run_dir=" in result.message
    assert run.config.read_text() == first.to_yaml()          # the stored config is untouched
    fewer = first.model_copy(update={"train": first.train.model_copy(update={"steps": 2})})
    assert config_changes(first, fewer) == ["train.steps: 4 -> 2"]
    # what a resume may change: more steps, supervision, where it runs
    more = first.model_copy(update={"train": first.train.model_copy(update={"steps": 9}), "launcher": "slurm",
                                    "supervise": first.supervise.model_copy(update={"max_relaunches": 7}),
                                    "metrics": first.metrics.model_copy(update={"tensorboard": True})})
    assert config_changes(first, more) == []
    check_rerun(run, more, first)
    with pytest.raises(RunDirInUse):
        check_rerun(run, changed, first)
    check_rerun(RunDir.at(tmp_path / "fresh"), changed, first)   # no results there: nothing to mix

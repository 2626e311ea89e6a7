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
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "-m", "gyre_hpc.substrate",
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


def test_a_stray_srun_client_of_an_ended_step_is_reaped_and_the_rerun_starts(tmp_path):
    """bench chaos: a head SIGKILLed in its batch job left its srun client hung after the job
    and its step had ended, and every rerun was refused. The next head kills such a client
    (Slurm no longer lists its step) and starts; a rank of the directory still refuses it."""
    import json

    from gyre_hpc.jobs.ownership import reap_stray_sruns

    run = RunDir.at(tmp_path / "run").make()
    (run.logs / "fleet.json").write_text(json.dumps({"step_id": "999999.0", "launch": 1}))   # not a live step
    argv = ["-c", "import time; time.sleep(60)", "-m", "gyre_hpc.substrate", "--run-dir", str(run.root)]
    stray = subprocess.Popen(["bash", "-c", 'exec -a srun "$0" "$@"', sys.executable, *argv])
    rank = subprocess.Popen([sys.executable, *argv])
    try:
        time.sleep(0.3)
        assert sorted(int(f.split()[1]) for f in live_fleet(run)) == sorted([stray.pid, rank.pid])
        assert reap_stray_sruns(run) == [f"pid {stray.pid} (srun of ended step 999999.0)"]
        # Gone when reaping returns (it waits for the kill), so the next look does not refuse for it.
        assert [int(f.split()[1]) for f in live_fleet(run)] == [rank.pid]   # a rank is never reaped
        stray.wait(5)
        result = _sup(run, build_config({"run_dir": str(run.root), "cells": {"count": 1}})).run_fleet()
        assert result.status == "refused" and f"pid {rank.pid}" in result.message
    finally:
        for p in (stray, rank):
            p.kill()
            p.wait()
    result = _sup(run, build_config({"run_dir": str(run.root), "cells": {"count": 1}})).run_fleet()
    assert result.status != "refused", result.message


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


def test_a_fleet_whose_head_lease_ran_out_checkpoints_and_exits(tmp_path):
    """Controller.head_gone reads the lease the supervisor renews (RunDir.head_alive)."""
    from types import SimpleNamespace

    from gyre_hpc.cells.controller import Controller

    run = RunDir.at(tmp_path / "run").make()
    seen = []
    fake = SimpleNamespace(cfg=build_config({"supervise": {"head_lease_s": 5}}), run=run,
                           result=SimpleNamespace(last_completed=3),
                           metrics=SimpleNamespace(event=lambda *a, **k: seen.append((a, k))))
    assert not Controller.head_gone(fake)                 # no lease file: no head to watch
    run.head_alive.touch()
    assert not Controller.head_gone(fake)                 # renewed just now
    old = time.time() - 6
    os.utime(run.head_alive, (old, old))
    assert Controller.head_gone(fake) and seen[0][0] == ("head_gone",)
    fake.cfg = build_config({"supervise": {"head_lease_s": 0}})
    assert not Controller.head_gone(fake)                 # 0: no lease


def test_the_supervisor_renews_the_lease_while_its_fleet_runs_and_drops_it_after(tmp_path):
    run = RunDir.at(tmp_path / "run").make()
    cfg = build_config({"run_dir": str(run.root), "cells": {"count": 1}, "supervise": {"poll_s": 0.05}})
    probe = ("import os, sys, time\n"
             "p = sys.argv[1]\n"
             "a = os.stat(p).st_mtime; time.sleep(0.6); b = os.stat(p).st_mtime\n"
             "raise SystemExit(0 if b > a else 9)")
    sup = Supervisor(cfg=cfg, run=run, launcher=LocalLauncher(), plan=local_plan(cfg),
                     argv=[sys.executable, "-c", probe, str(run.head_alive)], log=lambda m: None)
    result = sup.run_fleet()
    assert result.status == "finished", result.message
    assert not run.head_alive.exists()

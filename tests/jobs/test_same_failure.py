"""A fleet that fails the same way twice from the same checkpoint is not relaunched again: the
run fails naming the error the rank raised (``rundir.fleet_error``), after two launches, not
``supervise.max_relaunches`` + 1."""
from __future__ import annotations

import json

import pytest

from gyre_hpc.jobs.launchers import LocalLauncher
from gyre_hpc.jobs.plan import local_plan
from gyre_hpc.jobs.supervisor import Supervisor, fleet_argv
from gyre_hpc.rundir import fleet_error
from gyre_hpc.rundir.fleet_error import FleetError, same_failure
from gyre_hpc.rundir.layout import RunDir
from tests.jobs.slurm_jobs import events
from tests.rl.rl_helpers import rl_config, write_run_dir


def test_the_first_error_of_a_launch_is_kept_and_read_back(tmp_path):
    run = RunDir.at(tmp_path / "run").make()
    assert fleet_error.read(run) is None
    fleet_error.report(run, ValueError("bad weights"), rank=2)
    fleet_error.report(run, RuntimeError("peer gone"), rank=0)     # an echo of the first: not kept
    err = fleet_error.read(run)
    assert (err.kind, err.message, err.rank) == ("ValueError", "bad weights", 2)
    assert str(err) == "ValueError: bad weights (rank 2)"
    assert fleet_error.read(run, since=err.time + 1) is None       # an earlier launch's report is not this one's
    fleet_error.clear(run)
    assert fleet_error.read(run) is None
    run.fleet_error.write_text("{not json")                        # a report cut short reads as none
    assert fleet_error.read(run) is None


def test_only_the_same_error_from_the_same_checkpoint_is_the_same_failure():
    a = FleetError("CheckpointError", "x: config.json is not JSON", 1, 10.0)
    later = FleetError("CheckpointError", "x: config.json is not JSON", 2, 99.0)   # another rank, another time
    assert same_failure((a, None), (later, None))
    assert same_failure((a, 3), (later, 3))
    assert not same_failure((a, 3), (later, 4))                     # it made progress in between
    assert not same_failure((a, None), (FleetError("CheckpointError", "y", 1, 11.0), None))
    assert not same_failure((a, None), (FleetError("ValueError", a.message, 1, 11.0), None))
    assert not same_failure((None, None), (None, None))             # killed, segfaulted: relaunch
    assert not same_failure((a, None), (None, None))


@pytest.mark.mpi
def test_a_fleet_failing_the_same_way_twice_stops_after_two_launches_naming_the_error(tmp_path):
    """The case that showed it: a model.path whose config.json passes the preflight (it exists)
    and fails in every rank."""
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"]}))
    cfg = rl_config(tmp_path, f"model.path={bad}", "supervise.max_relaunches=3")
    run = write_run_dir(cfg)
    sup = Supervisor(cfg=cfg, run=run, launcher=LocalLauncher(), plan=local_plan(cfg),
                     argv=fleet_argv(run, workload="rl"), log=lambda m: None)
    result = sup.run_fleet()
    assert result.status == "failed" and result.exit_code == 1 and result.launches == 2
    assert "fleet failed twice from the start with the same error, CheckpointError:" in result.message
    assert "NoSuchModel" in result.message and result.message.count("fleet-") == 2     # both logs named
    assert [e for e, _, _ in events(run.root)] == ["launch", "exit", "relaunch", "exit", "fail"]

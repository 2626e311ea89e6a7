"""`gyre-hpc inspect`: a summary read from the run's own files; bad dirs and files named."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from gyre_hpc.config import build_config
from gyre_hpc.rundir.inspect import RunDirError, summarize
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import EventRow, MetricsWriter, StepRow, TimelineRow


def _run_dir(tmp_path, step_rows=(1, 2, 3), latest_step=3):
    run = RunDir.at(tmp_path / "run").make()
    run.config.write_text(build_config({"name": "t", "train": {"steps": 5}, "cells": {"count": 3}}).to_yaml())
    now = time.time()
    with MetricsWriter(run.metrics) as w:
        w.append([EventRow(now, "launch", -1, "attempt 1"), EventRow(now, "exit", 2, "fleet exit 137"),
                  EventRow(now, "relaunch", 2, "attempt 2")])
        w.append(StepRow(step=s, time=now, wall_s=0.1) for s in step_rows)
        w.append([TimelineRow(now, 1, "TRAIN", "flip_end", 1, bytes=2_000_000),
                  TimelineRow(now, 1, "ROLLOUT", "flip_end", 2),
                  TimelineRow(now, 2, "TRAIN", "flip_start", 2)])
    ck = run.checkpoints / f"step-{latest_step:08d}"
    ck.mkdir()
    (ck / "meta.json").write_text(json.dumps({"step": latest_step}))
    (run.checkpoints / "latest").write_text(ck.name + "\n")
    return run


def test_summary_counts_steps_relaunches_and_flips(tmp_path):
    run = _run_dir(tmp_path)
    s = summarize(run.root)
    assert (s.name, s.cells, s.steps_planned, s.steps_done, s.last_step) == ("t", 3, 5, 3, 3)
    assert s.repeated_steps == []
    assert s.checkpoint_step == 3
    assert (s.launches, s.relaunches, s.requeues) == (2, 1, 0)
    assert s.status == "running (or killed)"
    assert [(c.cell, c.to_train, c.to_rollout, c.bytes_moved) for c in s.cell_flips] == [(1, 1, 1, 2_000_000)]


def test_summary_flags_a_step_recorded_twice(tmp_path):
    run = _run_dir(tmp_path, step_rows=(1, 2, 2, 3))
    assert summarize(run.root).repeated_steps == [2]


def test_not_a_run_dir_is_named(tmp_path):
    with pytest.raises(RunDirError, match="is not a run directory: it has no config.yaml"):
        summarize(tmp_path)
    with pytest.raises(RunDirError, match="does not exist"):
        summarize(tmp_path / "nope")


def test_corrupt_files_are_named(tmp_path):
    run = _run_dir(tmp_path)
    (run.checkpoints / "latest").write_text("step-00000099\n")
    with pytest.raises(RunDirError, match=r"latest names 'step-00000099'"):
        summarize(run.root)
    run = _run_dir(tmp_path / "b")
    run.metrics.write_bytes(b"not hdf5 at all")
    with pytest.raises(RunDirError, match=r"metrics.h5 is corrupt or unreadable"):
        summarize(run.root)
    run = _run_dir(tmp_path / "c")
    run.config.write_text("cells: {count: zero}\n")
    with pytest.raises(RunDirError, match=r"(?s)config.yaml is unreadable: .*cells.count"):
        summarize(run.root)


def test_cli_prints_json_and_exits_1_on_a_bad_dir(tmp_path):
    run = _run_dir(tmp_path)
    cli = [sys.executable, "-c", "from gyre_hpc.cli import main; main()", "inspect"]
    out = subprocess.run(cli + [str(run.root), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["steps_done"] == 3
    table = subprocess.run(cli + [str(run.root)], capture_output=True, text=True)
    assert "3 of 5" in table.stdout and "relaunch" in table.stdout
    bad = subprocess.run(cli + [str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 1 and "not a run directory" in bad.stderr

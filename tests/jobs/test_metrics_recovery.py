"""A metrics writer killed mid-run must not lock the run out of its own metrics.h5."""
from __future__ import annotations

import subprocess
import sys

import h5py

from gyre_hpc.rundir.metrics import MetricsWriter, read_table, recover_unclosed

KILLED_WRITER = """
import sys, time
from gyre_hpc.rundir.metrics import MetricsWriter, StepRow
w = MetricsWriter(sys.argv[1], attrs={"run": "x"})
w.event("fleet_start", 1, "fresh")
w.append(StepRow(step=s, time=0.0, wall_s=0.1) for s in (1, 2))
print("written", flush=True)
time.sleep(60)
"""


def test_recover_unclosed_keeps_every_row_and_allows_a_new_writer(tmp_path):
    path = tmp_path / "metrics.h5"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.kill()
    proc.wait()
    try:
        h5py.File(path, "a", libver="latest").close()
        raise AssertionError("HDF5 accepted a writer on a file left open; recover_unclosed is moot")
    except OSError as exc:
        assert "already open for write" in str(exc)
    assert recover_unclosed(path) is True
    assert recover_unclosed(path) is False  # healthy now
    with MetricsWriter(path) as w:
        w.event("relaunch", 2, "attempt 2")
    ev = read_table(path, "events")
    assert list(ev["event"]) == ["fleet_start", "relaunch"]
    assert list(read_table(path, "steps")["step"]) == [1, 2]
    with h5py.File(path, "r") as f:
        assert f.attrs["run"] == "x"


def test_recover_unclosed_leaves_missing_and_healthy_files_alone(tmp_path):
    assert recover_unclosed(tmp_path / "none.h5") is False
    with MetricsWriter(tmp_path / "ok.h5") as w:
        w.event("launch")
    before = (tmp_path / "ok.h5").read_bytes()
    assert recover_unclosed(tmp_path / "ok.h5") is False
    assert (tmp_path / "ok.h5").read_bytes() == before


def test_recover_unclosed_drops_only_the_row_torn_by_the_kill(tmp_path):
    """Killed between column resizes: the last row exists in some columns only."""
    path = tmp_path / "metrics.h5"
    torn = KILLED_WRITER.replace('print("written", flush=True)', '''
grp = w._f["steps"]
for col in ("step", "time"):          # a third row, begun but never finished
    grp[col].resize((3,)); grp[col][2] = 3; grp[col].flush()
print("written", flush=True)''')
    proc = subprocess.Popen([sys.executable, "-c", torn, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "written"
    proc.kill()
    proc.wait()
    assert recover_unclosed(path) is True
    assert list(read_table(path, "steps")["step"]) == [1, 2]
    assert list(read_table(path, "events")["event"]) == ["fleet_start"]

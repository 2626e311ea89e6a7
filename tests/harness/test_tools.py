from __future__ import annotations

import pytest

from gyre_hpc.harness.confine import Limits
from gyre_hpc.harness.tools import ToolError, Workspace


def test_file_tools_read_write_append_and_list(tmp_path):
    ws = Workspace(tmp_path, Limits(file_size_mb=1), max_read_bytes=5, max_list_entries=3)
    assert ws.write("pkg/mod.py", b"x = 1\n") == 6
    ws.write("notes.txt", b"ab")
    ws.write("notes.txt", b"cd", append=True)
    assert (tmp_path / "notes.txt").read_bytes() == b"abcd"
    assert ws.read("pkg/mod.py") == b"x = 1"            # capped at max_read_bytes
    ws.write("z.txt", b"")
    ws.write("a.txt", b"")
    assert ws.list() == ["a.txt", "notes.txt", "pkg/mod.py"]   # sorted, capped at 3
    assert ws.list("pkg") == ["pkg/mod.py"]
    with pytest.raises(ToolError, match="no file 'missing'"):
        ws.read("missing")
    with pytest.raises(ToolError, match="is a directory"):
        ws.write("pkg", b"x")
    with pytest.raises(ToolError, match="no directory"):
        ws.list("notes.txt")
    with pytest.raises(ToolError, match="file size limit"):
        ws.write("big.bin", b"x" * (1024 * 1024 + 1))


def test_run_reports_exit_status_and_timeout_to_the_model(tmp_path):
    ws = Workspace(tmp_path)
    assert ws.run("echo hi; exit 3").describe() == "hi\n\n[exit 3]"
    slow = ws.run("sleep 5", wall_s=0.3)
    assert slow.timed_out and slow.describe().endswith("[killed: wall-clock timeout]")

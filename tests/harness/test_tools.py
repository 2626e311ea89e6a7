from __future__ import annotations

import pytest

from gyre_hpc.harness.beneath import remove_tree
from gyre_hpc.harness.confine import Limits
from gyre_hpc.harness.tasks import Task, TaskTest
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


# A concurrent swapper (another process, as a jail leftover or a second run would be) flips a
# file for a symlink to a secret outside, and a directory for a symlink to a directory
# outside, as fast as it can; the file tools race it for several seconds.
_SWAPPER = r'''
import os, sys, time
ws, secret, outside, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
os.chdir(ws)
end = time.monotonic() + seconds
while time.monotonic() < end:
    for name, target in (("f.txt", secret), ("d", outside)):
        try:
            os.symlink(target, name + ".lnk")
            os.rename(name, name + ".real")
            os.rename(name + ".lnk", name)
            os.rename(name, name + ".lnk")
            os.rename(name + ".real", name)
            os.unlink(name + ".lnk")
        except OSError:
            pass
'''


def test_file_tools_cannot_be_raced_by_a_symlink_swap(tmp_path):
    import subprocess
    import sys
    import time
    root = tmp_path / "ws"
    (root / "d").mkdir(parents=True)
    (root / "f.txt").write_text("inside")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    secret.chmod(0o600)
    outside = tmp_path / "private"
    outside.mkdir(mode=0o700)
    ws = Workspace(root)
    swapper = subprocess.Popen([sys.executable, "-c", _SWAPPER, str(root), str(secret), str(outside), "4"])
    reads = writes = refused = 0
    try:
        end = time.monotonic() + 4
        while time.monotonic() < end:
            for op in (lambda: ws.read("f.txt"), lambda: ws.write("d/out.txt", b"x"),
                       lambda: ws.write("d/sub/deeper.txt", b"y"), lambda: ws.list("d")):
                try:
                    got = op()
                    if isinstance(got, bytes):
                        assert b"TOPSECRET" not in got
                        reads += 1
                    else:
                        writes += 1
                except ToolError:
                    refused += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert list(outside.iterdir()) == [] and secret.read_text() == "TOPSECRET"
    assert reads > 0 and writes > 0   # the race was actually run, not refused wholesale


def test_a_3000_deep_tree_is_listed_and_written_without_recursion(tmp_path):
    import os
    root = tmp_path / "ws"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(3000):   # deeper than PATH_MAX allows by name, and than Python's recursion limit
        os.mkdir("d", dir_fd=fd)
        nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
    os.close(os.open("leaf.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    try:
        (root / "top.txt").write_text("t")
        ws = Workspace(root, max_list_entries=5)
        assert ws.list() == ["d/" * 3000 + "leaf.txt", "top.txt"]
        ws.write("d/d/x.txt", b"ok")
        assert ws.read("d/d/x.txt") == b"ok"
        assert ws.run("echo alive").output == b"alive\n"   # the jail's own walk copes too
        task = Task("t", "s", tests=(TaskTest("t", "pass"),))
        task.materialize(root)                             # resetting the workspace copes too
        assert list(root.iterdir()) == []
    finally:
        # never leave it to pytest's tmp_path cleanup: shutil.rmtree recurses and would fail
        # every later pytest session on this machine
        if root.exists():
            remove_tree(root)


@pytest.mark.parametrize("use_openat2", [True, False], ids=["openat2", "component-walk"])
def test_open_beneath_refuses_every_way_out_in_both_modes(tmp_path, use_openat2):
    import errno
    import os

    from gyre_hpc.harness.beneath import open_beneath
    (tmp_path / "out.txt").write_text("out")
    root = tmp_path / "ws"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "f.txt").write_text("in")
    os.symlink(tmp_path / "out.txt", root / "abs_link")
    os.symlink("../out.txt", root / "rel_link")
    os.symlink("../../out.txt", root / "sub" / "up_link")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        for bad in ("abs_link", "rel_link", "sub/up_link", "../out.txt", "sub/../../out.txt", "/etc/passwd"):
            with pytest.raises(OSError) as e:
                os.close(open_beneath(fd, bad, os.O_RDONLY, use_openat2=use_openat2))
            assert e.value.errno in (errno.EXDEV, errno.ELOOP), bad
        got = open_beneath(fd, "sub/f.txt", os.O_RDONLY, use_openat2=use_openat2)
        assert os.read(got, 10) == b"in"
        os.close(got)
    finally:
        os.close(fd)

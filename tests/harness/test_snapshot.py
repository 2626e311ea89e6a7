"""Workspace snapshots: exact round trips, content dedup, and a hostile workspace contained."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gyre_hpc.harness.beneath import remove_tree
from gyre_hpc.harness.snapshot import Manifest, SnapshotError, SnapshotStore, snapshot_due
from workspace_tree import tree


def make_ws(root: Path) -> Path:
    root.mkdir()
    (root / "src" / "deep").mkdir(parents=True)
    (root / "src" / "a.py").write_text("def f(x):\n    return x\n")
    (root / "src" / "deep" / "b.bin").write_bytes(bytes(range(256)) * 10)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o755)
    (root / "empty").write_bytes(b"")
    (root / "ro").mkdir()
    (root / "ro" / "kept.txt").write_text("read only dir")
    os.chmod(root / "ro", 0o555)
    os.symlink("src/a.py", root / "inside-link")
    return root


def test_round_trip_is_exact_and_restore_removes_what_came_after(tmp_path):
    ws = make_ws(tmp_path / "ws")
    store = SnapshotStore(tmp_path / "store")
    before = tree(ws)
    mtime = (ws / "src" / "a.py").stat().st_mtime_ns
    m = store.snapshot(ws, call=7)
    assert m.call == 7 and store.calls() == [7]
    # The run goes on: a file changed, one deleted, one added, a directory added, a mode changed.
    (ws / "src" / "a.py").write_text("changed")
    (ws / "empty").unlink()
    (ws / "new.txt").write_text("new")
    (ws / "newdir" / "x").mkdir(parents=True)
    os.chmod(ws / "run.sh", 0o600)
    store.restore(store.load(7), ws)
    assert tree(ws) == before
    assert (ws / "src" / "a.py").stat().st_mtime_ns == mtime
    assert not (tmp_path / ".ws.restoring").exists() and not (tmp_path / ".ws.discarded").exists()
    # Restored files are copies, one link each: the file tools refuse a file with two.
    assert (ws / "src" / "a.py").stat().st_nlink == 1
    # Restoring to a fresh path works too, and the store is not changed by writes after a restore.
    (ws / "src" / "a.py").write_text("written after restore")
    store.restore(store.load(7), tmp_path / "again")
    assert tree(tmp_path / "again") == before


def test_unchanged_tree_adds_no_blob_bytes_and_a_change_adds_only_itself(tmp_path):
    ws = make_ws(tmp_path / "ws")
    store = SnapshotStore(tmp_path / "store")
    first = store.snapshot(ws, 0)
    assert first.new_bytes == len("def f(x):\n    return x\n") + 2560 + len("#!/bin/sh\necho hi\n") + \
        len("read only dir")
    held = store.blob_bytes()
    assert held == first.new_bytes
    second = store.snapshot(ws, 8)
    assert second.new_bytes == 0 and store.blob_bytes() == held
    # A fresh store object on the same directory (a relaunch) knows its blobs from disk.
    (ws / "src" / "a.py").write_text("v2")
    third = SnapshotStore(tmp_path / "store").snapshot(ws, 16)
    assert third.new_bytes == 2 and store.blob_bytes() == held + 2
    assert store.latest().call == 16 and store.latest(at_most=15).call == 8 and store.latest(at_most=-1) is None
    assert store.drop_after(8) == [16] and store.calls() == [0, 8] and store.blob_bytes() == held + 2


def test_manifest_round_trips_and_bad_one_names_the_file(tmp_path):
    ws = make_ws(tmp_path / "ws")
    store = SnapshotStore(tmp_path / "store")
    m = store.snapshot(ws, 3)
    assert Manifest.from_json(m.to_json(), Path("x")) == m
    store.manifest_path(4).write_text('{"format": 1, "name": "x"}')
    with pytest.raises(SnapshotError, match="call-00000004.json is not a manifest"):
        store.load(4)
    with pytest.raises(SnapshotError, match="no snapshot of call 5"):
        store.load(5)


def test_damaged_blob_is_refused_not_restored(tmp_path):
    ws = make_ws(tmp_path / "ws")
    store = SnapshotStore(tmp_path / "store")
    m = store.snapshot(ws, 0)
    sha = next(e.sha256 for e in m.entries if e.path == "src/a.py")
    os.chmod(store.blob_path(sha), 0o644)
    store.blob_path(sha).write_text("tampered")
    with pytest.raises(SnapshotError, match="src/a.py.*damaged"):
        store.restore(m, tmp_path / "out")
    assert sorted(os.listdir(tmp_path)) == ["store", "ws"]     # no workspace, no staging left


def test_symlinks_outside_are_recorded_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("SECRET")
    ws = tmp_path / "ws"
    ws.mkdir()
    os.symlink("/etc/passwd", ws / "passwd")
    os.symlink("..", ws / "parent")
    os.symlink(str(outside), ws / "out")
    os.symlink("../outside/secret", ws / "rel")
    store = SnapshotStore(tmp_path / "store")
    m = store.snapshot(ws, 0)
    assert {e.path: e.target for e in m.entries if e.kind == "link"} == {
        "passwd": "/etc/passwd", "parent": "..", "out": str(outside), "rel": "../outside/secret"}
    assert m.new_bytes == 0 and store.blob_bytes() == 0     # nothing behind a link was read
    # At restore the workspace holds links where the snapshot had files: restore writes through none.
    ws2 = tmp_path / "ws2"
    ws2.mkdir()
    (ws2 / "f").write_text("mine")
    store2 = SnapshotStore(tmp_path / "store2")
    m2 = store2.snapshot(ws2, 0)
    (ws2 / "f").unlink()
    os.symlink(str(outside / "secret"), ws2 / "f")
    os.symlink(str(outside), ws2 / "d")
    store2.restore(m2, ws2)
    assert (outside / "secret").read_text() == "SECRET" and sorted(os.listdir(outside)) == ["secret"]
    assert tree(ws2) == {"f": ("file", 0o644, b"mine")}
    store.restore(m, ws2)
    assert tree(ws2) == tree(ws) and (outside / "secret").read_text() == "SECRET"


def test_forged_manifest_cannot_write_outside(tmp_path):
    ws = make_ws(tmp_path / "ws")
    store = SnapshotStore(tmp_path / "store")
    m = store.snapshot(ws, 0)
    for bad in ("../escape", "/abs", "a/../../x", "link/x"):
        entries = m.entries + (type(m.entries[0])("link", "link", 0, target=str(tmp_path)),
                               type(m.entries[0])(bad, "dir", 0o755))
        forged = Manifest("forged", 0, entries)
        with pytest.raises((SnapshotError, OSError)):
            store.restore(forged, tmp_path / "out")
        assert not (tmp_path / "escape").exists() and not (tmp_path / "x").exists()


def test_fifo_is_recreated_not_opened_and_socket_is_skipped(tmp_path):
    import socket
    ws = tmp_path / "ws"
    ws.mkdir()
    os.mkfifo(ws / "pipe", 0o640)      # opening it to read would block the snapshot forever
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ws / "sock"))
    try:
        store = SnapshotStore(tmp_path / "store")
        m = store.snapshot(ws, 0)
    finally:
        sock.close()
    assert m.skipped == (("sock", "socket"),)
    store.restore(m, tmp_path / "out")
    assert tree(tmp_path / "out") == {"pipe": ("fifo", 0o640)}


def test_huge_sparse_file_refuses_the_snapshot_without_reading_it(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    with open(ws / "sparse", "wb") as f:
        f.truncate(1 << 40)          # 1 TiB of holes
    store = SnapshotStore(tmp_path / "store")
    with pytest.raises(SnapshotError, match=r"sparse is 1099511627776 bytes, past the snapshot limit"):
        store.snapshot(ws, 0)
    assert store.calls() == [] and store.blob_bytes() == 0
    small = SnapshotStore(tmp_path / "small", max_total_bytes=10)
    (ws / "sparse").unlink()
    (ws / "a").write_bytes(b"x" * 6)
    (ws / "b").write_bytes(b"y" * 6)
    with pytest.raises(SnapshotError, match="more than 10 bytes"):
        small.snapshot(ws, 0)


def test_setuid_bits_are_dropped_and_store_inside_workspace_refused(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "suid").write_text("x")
    os.chmod(ws / "suid", 0o4755)
    store = SnapshotStore(tmp_path / "store")
    store.restore(store.snapshot(ws, 0), tmp_path / "out")
    assert (tmp_path / "out" / "suid").stat().st_mode & 0o7777 == 0o755
    with pytest.raises(SnapshotError, match="inside workspace"):
        SnapshotStore(ws / ".snap").snapshot(ws, 0)
    os.symlink("/etc", tmp_path / "ws-link")        # the workspace path itself a link: not followed
    with pytest.raises(SnapshotError, match="ws-link cannot be snapshotted"):
        store.snapshot(tmp_path / "ws-link", 1)
    store.restore(store.load(0), tmp_path / "ws-link")      # replaces the link, writes nothing in /etc
    assert not os.path.islink(tmp_path / "ws-link") and not os.path.exists("/etc/suid")
    store.restore(store.load(0), tmp_path / "new" / "parent" / "ws")
    assert (tmp_path / "new" / "parent" / "ws" / "suid").read_text() == "x"


def test_deep_tree_round_trips(tmp_path):
    ws = tmp_path / "ws"
    try:
        _deep_tree_round_trips(tmp_path, ws)
    finally:
        remove_tree(ws)    # pytest's own clean-up of tmp_path recurses: a failed run must not leave the tree


def _deep_tree_round_trips(tmp_path, ws):
    ws.mkdir()
    fd = os.open(ws, os.O_RDONLY)
    for _ in range(1500):        # deeper than Python's recursion limit (shutil.rmtree recurses)
        os.mkdir("d", dir_fd=fd)
        nxt = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    store = SnapshotStore(tmp_path / "store", durable=False)
    m = store.snapshot(ws, 0)
    assert len(m.entries) == 1501
    (ws / "top.txt").write_text("later")
    store.restore(m, ws)
    assert os.listdir(ws) == ["d"]
    # Deeper than a restore could open: refused at snapshot time, naming the path's length.
    fd = os.open(ws, os.O_RDONLY)
    for _ in range(2100):
        os.mkdir("e", dir_fd=fd)
        nxt = os.open("e", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(fd)
    with pytest.raises(SnapshotError, match="has a path of 4001 bytes"):
        store.snapshot(ws, 1)
    assert store.calls() == [0]


def test_snapshot_due():
    assert [k for k in range(20) if snapshot_due(k, 8)] == [7, 15]
    with pytest.raises(ValueError, match="snapshot_every=0"):
        snapshot_due(3, 0)

"""Durable writes on a real filesystem: what a reader finds after a failure at each step."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_hpc import fsio


@pytest.fixture
def synced(monkeypatch):
    """Every path fsynced, in order, with the renames between them (``("replace", dst)``)."""
    events: list = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("replace", str(dst)))

    def rename(src, dst):
        real_rename(src, dst)
        events.append(("rename", str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    return events


def fsynced(events) -> list[str]:
    return [p for kind, p in events if kind == "fsync"]


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def read_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


OLD = {"meta.json": "old", "state/a.bin": "old-a", "state/b.bin": "old-b"}
NEW = {"meta.json": "new", "state/a.bin": "new-a", "state/c.bin": "new-c"}


# ---- files ---------------------------------------------------------------------------------

def test_write_text_replaces_the_content_and_leaves_only_the_target(tmp_path):
    target = tmp_path / "latest"
    fsio.write_text(target, "step-00000001\n")
    fsio.write_text(target, "step-00000002\n")
    assert target.read_text() == "step-00000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    fsio.write_bytes(tmp_path / "blob", b"\x00\xffbytes")
    assert (tmp_path / "blob").read_bytes() == b"\x00\xffbytes"


def test_a_write_failing_midway_keeps_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "commit.json"
    target.write_text("old")

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(fsio, "open", lambda path, mode: HalfWritten(open(path, mode)), raising=False)
    with pytest.raises(OSError, match="No space"):
        fsio.write_text(target, "new content, long enough to be cut in half")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["commit.json"]


def test_a_failed_fsync_keeps_the_old_content(tmp_path, monkeypatch):
    target = tmp_path / "config.yaml"
    target.write_text("old")

    def fail(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output"):
        fsio.write_text(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_writer_killed_before_the_rename_leaves_the_old_content_and_a_recognisable_temp(tmp_path):
    target = tmp_path / "commit.json"
    target.write_text("old")
    child = (
        "import os, sys\n"
        "from gyre_hpc import fsio\n"
        "os.replace = lambda src, dst: os._exit(9)\n"      # killed with the temp file written
        "fsio.write_text(sys.argv[1], 'new')\n"
    )
    rc = subprocess.run([sys.executable, "-c", child, str(target)], timeout=60).returncode
    assert rc == 9
    assert target.read_text() == "old"
    left = [p.name for p in tmp_path.iterdir() if p.name != "commit.json"]
    assert len(left) == 1 and fsio.is_temp(left[0]), left
    assert (tmp_path / left[0]).read_text() == "new"
    assert not any(fsio.is_temp(n) for n in ("commit.json", ".commit.json", "step-00000002.tmp", "config.yaml.tmp"))


def test_a_durable_write_fsyncs_the_file_before_the_rename_and_the_directory_after(tmp_path, synced):
    target = tmp_path / "fleet.json"
    fsio.write_text(target, "{}")
    (f_kind, temp), replaced, dir_sync = synced
    assert (f_kind, replaced, dir_sync) == ("fsync", ("replace", str(target)), ("fsync", str(tmp_path)))
    assert fsio.is_temp(Path(temp).name) and Path(temp).parent == tmp_path


def test_a_volatile_write_is_atomic_without_fsync(tmp_path, synced):
    fsio.write_text(tmp_path / "commit.json", "x", durable=False)
    assert fsynced(synced) == [] and synced == [("replace", str(tmp_path / "commit.json"))]
    assert (tmp_path / "commit.json").read_text() == "x"


def test_fsync_file_flushes_python_buffers_first(tmp_path):
    path = tmp_path / "journal"
    with open(path, "wb") as f:
        f.write(b"record")
        fsio.sync_file(f)
        assert path.read_bytes() == b"record"      # on disk while the handle is still open


def test_replace_file_syncs_the_content_then_both_directories(tmp_path, synced):
    (tmp_path / "a").mkdir()
    src = tmp_path / "a" / "metrics.h5.recovering"
    src.write_text("rows")
    dst = tmp_path / "metrics.h5"
    dst.write_text("torn")
    fsio.replace_file(src, dst)
    assert dst.read_text() == "rows" and not src.exists()
    assert synced == [("fsync", str(src)), ("replace", str(dst)),
                      ("fsync", str(tmp_path)), ("fsync", str(tmp_path / "a"))]


def test_fsync_tree_and_fsync_paths_reach_every_file_and_directory(tmp_path, synced):
    tree = write_tree(tmp_path / "t", {f"d{i}/f{j}": "x" for i in range(3) for j in range(4)})
    fsio.sync_tree(tree)
    files = {str(p) for p in tree.rglob("*") if p.is_file()}
    dirs = {str(tree)} | {str(p) for p in tree.rglob("*") if p.is_dir()}
    seen = fsynced(synced)
    assert set(seen) == files | dirs and len(seen) == len(files | dirs)
    assert max(seen.index(f) for f in files) < min(seen.index(d) for d in dirs)   # files, then entries
    synced.clear()
    fsio.sync_paths([])
    fsio.sync_paths(sorted(files)[:1])
    assert fsynced(synced) == sorted(files)[:1]


# ---- directories ---------------------------------------------------------------------------

def test_publish_dir_moves_a_built_tree_in_and_never_over_another(tmp_path, synced):
    staged = write_tree(tmp_path / ".store.creating", NEW)
    fsio.publish_dir(staged, tmp_path / "store")
    assert read_tree(tmp_path / "store") == NEW and not staged.exists()
    assert set(fsynced(synced)) >= {str(tmp_path / ".store.creating" / "meta.json"), str(tmp_path)}
    other = write_tree(tmp_path / ".store.other", OLD)
    with pytest.raises(OSError):
        fsio.publish_dir(other, tmp_path / "store")
    assert read_tree(tmp_path / "store") == NEW and read_tree(other) == OLD


def test_replace_dir_leaves_exactly_the_new_tree(tmp_path, synced):
    path = write_tree(tmp_path / "step-00000002", OLD)
    staged = write_tree(tmp_path / "step-00000002.tmp", NEW)
    fsio.replace_dir(staged, path)
    assert read_tree(path) == NEW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    renames = [e for e in synced if e[0] == "rename"]
    assert renames == [("rename", str(tmp_path / ".step-00000002.replaced")), ("rename", str(path))]
    # the new tree is durable before it is renamed in, and the renames after
    assert synced.index(("fsync", str(staged / "state" / "c.bin"))) < synced.index(renames[0])
    assert synced[synced.index(renames[1]) + 1] == ("fsync", str(tmp_path))


def test_replace_dir_where_nothing_was(tmp_path):
    fsio.replace_dir(write_tree(tmp_path / ".key.123", NEW), tmp_path / "key", durable=False)
    assert read_tree(tmp_path / "key") == NEW and [p.name for p in tmp_path.iterdir()] == ["key"]


def test_a_crash_between_the_renames_is_recovered_to_the_old_tree(tmp_path, monkeypatch):
    path = write_tree(tmp_path / "ckpt", OLD)
    staged = write_tree(tmp_path / "ckpt.tmp", NEW)
    real_rename = os.rename

    def killed_renaming_in(src, dst):
        if Path(dst) == path:
            raise OSError("killed between the renames")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_renaming_in)
    with pytest.raises(OSError, match="between the renames"):
        fsio.replace_dir(staged, path)
    monkeypatch.undo()
    assert not path.exists()                       # the instant the old code also had ...
    assert fsio.recover_dir(path) is True          # ... but here the old tree comes back
    assert read_tree(path) == OLD and read_tree(staged) == NEW
    assert fsio.recover_dir(path) is False
    fsio.replace_dir(staged, path)                 # the writer's redo
    assert read_tree(path) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_crash_before_the_old_tree_is_removed_is_recovered_to_the_new_tree(tmp_path, monkeypatch):
    path = write_tree(tmp_path / "ckpt", OLD)
    staged = write_tree(tmp_path / "ckpt.tmp", NEW)

    def half_rmtree(p, *a, **k):
        (Path(p) / "meta.json").unlink()           # killed part way through the removal
        raise OSError("killed while removing the old tree")

    monkeypatch.setattr(shutil, "rmtree", half_rmtree)
    with pytest.raises(OSError, match="removing the old tree"):
        fsio.replace_dir(staged, path)
    monkeypatch.undo()
    assert read_tree(path) == NEW
    assert fsio.recover_dir(path) is True
    assert read_tree(path) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_replace_dir_settles_an_earlier_interrupted_replace_first(tmp_path):
    path = tmp_path / "key"
    write_tree(tmp_path / ".key.replaced", OLD)     # a crash between the renames, nothing at path
    fsio.replace_dir(write_tree(tmp_path / "staged", NEW), path)
    assert read_tree(path) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["key"]


def test_at_every_step_of_replace_dir_the_path_holds_or_recovers_a_whole_tree(tmp_path, monkeypatch):
    area = tmp_path / "area"
    path = write_tree(area / "ckpt", OLD)
    staged = write_tree(area / "ckpt.tmp", NEW)
    seen = []

    def crash_here():
        # A crash now, then recovery: on a copy, so the real replace goes on.
        snap = tmp_path / f"snap{len(seen)}"
        shutil.copytree(area, snap)
        fsio.recover_dir(snap / "ckpt")
        seen.append(read_tree(snap / "ckpt"))

    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(src, dst):
        if Path(dst).parent != area:               # recovery's own rename, on a snapshot
            return real_rename(src, dst)
        crash_here()
        real_rename(src, dst)
        crash_here()

    def rmtree(p, *a, **k):
        if Path(p).parent == area:
            crash_here()
        real_rmtree(p, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    fsio.replace_dir(staged, path)
    monkeypatch.undo()
    crash_here()
    assert seen == [OLD, OLD, OLD, NEW, NEW, NEW]   # before/after each rename, before removal, done


def test_recover_dirs_settles_every_interrupted_replace_in_a_directory(tmp_path):
    write_tree(tmp_path / ".step-00000003.replaced", OLD)          # between the renames
    write_tree(tmp_path / "step-00000004", NEW)
    write_tree(tmp_path / ".step-00000004.replaced", OLD)          # before the removal
    write_tree(tmp_path / "step-00000005", NEW)                    # nothing interrupted
    assert fsio.recover_dirs(tmp_path) == [tmp_path / "step-00000003", tmp_path / "step-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]
    assert read_tree(tmp_path / "step-00000003") == OLD and read_tree(tmp_path / "step-00000004") == NEW
    assert fsio.recover_dirs(tmp_path) == [] and fsio.recover_dirs(tmp_path / "missing") == []

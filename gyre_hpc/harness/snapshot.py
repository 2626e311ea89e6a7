"""Workspace snapshots: a run's workspace saved every few calls, so a resumed run replays only
the calls after the last one (design.md section 11).

A content-addressed store: a snapshot is a small JSON manifest (every entry's path, type,
mode, mtime and, for a file, the sha256 of its bytes); file bytes live once per store under
``blobs/<sha256[:2]>/<sha256>``, so a file unchanged since an earlier snapshot costs no new
bytes, only its manifest line.

Why copies, not hard links, in both directions: a hard link between the store and the
workspace is one inode, so a later in-place write in the workspace (a tool ``append``, a
command's ``>>``) would rewrite the stored blob, and the jail chowns the workspace tree to
the command's uid, which would then own the blob. The file tools also refuse any file with a
second link (``tools``), so a workspace restored as links would stop the run. This machine's
ext4 has no reflinks; restore is rare (a resume) and a snapshot copies only new content.

The workspace is hostile (a model wrote it): the walk is ``beneath.walk`` (never follows a
link, bounded entries); a file is opened through its parent's fd with ``O_NOFOLLOW`` and
checked to be the inode the walk saw; a symlink is recorded as its target text and recreated
as a link, never read through; a FIFO is recreated, never opened; sockets and devices are
skipped and named in the manifest; a file past ``max_file_bytes`` (apparent size: a sparse
1 TiB file is 1 TiB to read) refuses the snapshot with an error naming it. Modes are kept
to their permission bits: a restore by root must not make a setuid file. Restore builds the
tree beside the workspace through ``beneath`` (no step can leave it) and swaps it in.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc import fsio
from gyre_hpc.harness import beneath

FORMAT = 1
MAX_FILE_BYTES = 64 << 20
MAX_TOTAL_BYTES = 1 << 30
MAX_ENTRIES = 200_000
# A restore opens each entry's parent by its relative path (one ``openat2``, the kernel
# guarding every step); the kernel refuses a path of PATH_MAX (4096) bytes or more.
MAX_PATH_BYTES = 4000
_MODE_BITS = 0o777


class SnapshotError(ValueError):
    """A workspace that cannot be snapshotted, or a store or manifest that cannot be trusted;
    the message names the path."""


@dataclass(frozen=True)
class Entry:
    path: str                 # relative, "/"-separated; "" is the workspace root itself
    kind: str                 # "dir", "file", "link" or "fifo"
    mode: int = 0o644         # permission bits only
    mtime_ns: int = 0
    sha256: str = ""          # file
    size: int = 0             # file
    target: str = ""          # link: the link's text, never resolved


@dataclass(frozen=True)
class Manifest:
    name: str
    call: int                              # the last call whose effects the snapshot holds
    entries: tuple[Entry, ...]
    skipped: tuple[tuple[str, str], ...] = ()   # (path, kind) of sockets and devices left out
    new_bytes: int = 0                     # blob bytes this snapshot added to the store
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "name": self.name, "call": self.call,
                           "entries": [{k: v for k, v in e.__dict__.items() if v not in ("", 0) or k in ("path", "mode")}
                                       for e in self.entries],
                           "skipped": [list(s) for s in self.skipped], "new_bytes": self.new_bytes,
                           "wall_s": self.wall_s})

    @classmethod
    def from_json(cls, text: str, where: Path) -> "Manifest":
        try:
            rec = json.loads(text)
            if rec.get("format") != FORMAT:
                raise SnapshotError(f"snapshot manifest {where} has format {rec.get('format')!r}, not {FORMAT}")
            entries = tuple(Entry(**e) for e in rec["entries"])
            return cls(rec["name"], int(rec["call"]), entries, tuple(tuple(s) for s in rec["skipped"]),
                       int(rec["new_bytes"]), float(rec["wall_s"]))
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SnapshotError(f"snapshot manifest {where} is not a manifest: {exc}") from None


@dataclass
class SnapshotStore:
    """Snapshots of one run's workspace (``root``: a directory of the run, never inside the
    workspace). ``durable``: blobs and manifests fsynced before a manifest names them."""

    root: Path
    max_file_bytes: int = MAX_FILE_BYTES
    max_total_bytes: int = MAX_TOTAL_BYTES
    max_entries: int = MAX_ENTRIES
    durable: bool = True
    _blobs: set[str] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        for name in ("max_file_bytes", "max_total_bytes", "max_entries"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SnapshotStore.{name}={getattr(self, name)} must be > 0")
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "snapshots").mkdir(exist_ok=True)

    # ---- store layout -------------------------------------------------------------------
    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / sha

    def manifest_path(self, call: int) -> Path:
        return self.root / "snapshots" / f"call-{call:08d}.json"

    def calls(self) -> list[int]:
        """Calls with a complete snapshot, ascending (a killed writer's temp files are not)."""
        out = []
        for p in (self.root / "snapshots").iterdir():
            if p.name.startswith("call-") and p.name.endswith(".json"):
                out.append(int(p.name[5:-5]))
        return sorted(out)

    def latest(self, at_most: int | None = None) -> Manifest | None:
        """The newest snapshot (of a call <= ``at_most``), or None."""
        calls = [c for c in self.calls() if at_most is None or c <= at_most]
        return self.load(calls[-1]) if calls else None

    def load(self, call: int) -> Manifest:
        p = self.manifest_path(call)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise SnapshotError(f"no snapshot of call {call} in {self.root} (there are: {self.calls()})") from None
        return Manifest.from_json(text, p)

    def drop_after(self, call: int) -> list[int]:
        """Remove the snapshots of calls after ``call`` (a run started again from its first
        call must not resume into an earlier attempt's workspace); the calls removed. Blobs
        stay: content-named, they are right for whoever names them."""
        gone = [c for c in self.calls() if c > call]
        for c in gone:
            self.manifest_path(c).unlink(missing_ok=True)
        if gone and self.durable:
            fsio.sync_path(self.root / "snapshots")
        return gone

    def blob_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "blobs").glob("*/*") if not fsio.is_temp(p.name))

    # ---- snapshot -----------------------------------------------------------------------
    def snapshot(self, workspace: str | Path, call: int) -> Manifest:
        """Save ``workspace`` as it is after call ``call``; atomic: the manifest appears whole,
        after every blob it names, or not at all."""
        if call < 0:
            raise ValueError(f"snapshot call={call} must be >= 0")
        start = time.perf_counter()
        ws = Path(workspace)
        if self.root.resolve().is_relative_to(ws.resolve()):
            raise SnapshotError(f"snapshot store {self.root} is inside workspace {ws}: the run could rewrite it")
        entries: list[Entry] = []
        skipped: list[tuple[str, str]] = []
        written: list[Path] = []
        total = new_bytes = 0
        try:
            root_fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SnapshotError(f"workspace {ws} cannot be snapshotted: {exc.strerror} (a link is not followed)") from None
        walk = beneath.walk(root_fd, max_entries=self.max_entries)
        try:
            top = os.fstat(root_fd)
            entries.append(Entry("", "dir", top.st_mode & _MODE_BITS, top.st_mtime_ns))
            # Each entry is handled as the walk yields it: its parent fd is valid until the next.
            while True:
                try:
                    rel, st, parent_fd, name = next(walk)
                except StopIteration:
                    break
                except RuntimeError as exc:
                    raise SnapshotError(f"workspace {ws} cannot be snapshotted: {exc}") from None
                if len(os.fsencode(rel)) >= MAX_PATH_BYTES:
                    raise SnapshotError(f"workspace {ws} has a path of {len(os.fsencode(rel))} bytes "
                                        f"({rel[:60]}...): past the {MAX_PATH_BYTES} a restore can open")
                mode = st.st_mode & _MODE_BITS
                if stat.S_ISDIR(st.st_mode):
                    entries.append(Entry(rel, "dir", mode, st.st_mtime_ns))
                elif stat.S_ISLNK(st.st_mode):
                    entries.append(Entry(rel, "link", 0, st.st_mtime_ns, target=os.readlink(name, dir_fd=parent_fd)))
                elif stat.S_ISFIFO(st.st_mode):
                    entries.append(Entry(rel, "fifo", mode, st.st_mtime_ns))
                elif stat.S_ISREG(st.st_mode):
                    if st.st_size > self.max_file_bytes:
                        raise SnapshotError(f"workspace file {ws / rel} is {st.st_size} bytes, past the snapshot "
                                            f"limit of {self.max_file_bytes} per file (a sparse file counts its size)")
                    total += st.st_size
                    if total > self.max_total_bytes:
                        raise SnapshotError(f"workspace {ws} holds more than {self.max_total_bytes} bytes of files "
                                            f"(reached at {rel}): past the snapshot limit")
                    data = _read_regular(parent_fd, name, st, ws / rel)
                    sha = hashlib.sha256(data).hexdigest()
                    if self._store_blob(sha, data):
                        written.append(self.blob_path(sha))
                        new_bytes += len(data)
                    entries.append(Entry(rel, "file", mode, st.st_mtime_ns, sha, len(data)))
                else:
                    skipped.append((rel, _kind(st.st_mode)))
        finally:
            walk.close()
            os.close(root_fd)
        if self.durable and written:
            fsio.sync_paths(written)
            fsio.sync_paths({p.parent for p in written})
        manifest = Manifest(f"call-{call:08d}", call, tuple(entries), tuple(skipped), new_bytes,
                            time.perf_counter() - start)
        fsio.write_text(self.manifest_path(call), manifest.to_json(), durable=self.durable)
        return manifest

    def _store_blob(self, sha: str, data: bytes) -> bool:
        """Write a blob unless the store has it; True if written. Content-named, so a blob
        present is the right one (a torn one is never present: written by rename)."""
        if sha in self._blobs:
            return False
        p = self.blob_path(sha)
        if p.exists():
            self._blobs.add(sha)
            return False
        p.parent.mkdir(exist_ok=True)
        fsio.write_bytes(p, data, durable=False)   # synced together with the others in ``snapshot``
        os.chmod(p, 0o444)
        self._blobs.add(sha)
        return True

    # ---- restore ------------------------------------------------------------------------
    def restore(self, manifest: Manifest, workspace: str | Path) -> None:
        """Make ``workspace`` exactly the snapshot: its files, directories, links, FIFOs, modes
        and mtimes, nothing else (what was made since is gone). Not atomic, and need not be:
        the store is untouched, so a restore a crash interrupted is simply done again."""
        ws = Path(workspace).absolute()
        staged = ws.with_name(f".{ws.name}.restoring")
        discarded = ws.with_name(f".{ws.name}.discarded")
        ws.parent.mkdir(parents=True, exist_ok=True)
        for leftover in (staged, discarded):
            if os.path.lexists(leftover):
                _remove(leftover)
        os.mkdir(staged, 0o700)
        fd = os.open(staged, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._build(manifest, fd)
        except BaseException:
            os.close(fd)
            _remove(staged)
            raise
        os.close(fd)
        if os.path.lexists(ws):
            os.rename(ws, discarded)
        os.rename(staged, ws)
        if os.path.lexists(discarded):
            _remove(discarded)

    def _build(self, manifest: Manifest, root_fd: int) -> None:
        dirs: list[Entry] = []
        for e in manifest.entries:
            if e.path == "":
                dirs.append(e)
                continue
            _check_rel(e.path, manifest.name)
            parent, name = os.path.split(e.path)
            pfd = beneath.open_beneath(root_fd, parent, os.O_PATH | os.O_DIRECTORY) if parent else os.dup(root_fd)
            try:
                if e.kind == "dir":
                    os.mkdir(name, 0o700, dir_fd=pfd)
                    dirs.append(e)
                elif e.kind == "file":
                    data = self._read_blob(e)
                    ffd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                  dir_fd=pfd)
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(ffd, view):]
                        os.fchmod(ffd, e.mode & _MODE_BITS)
                        os.utime(ffd, ns=(e.mtime_ns, e.mtime_ns))
                    finally:
                        os.close(ffd)
                elif e.kind == "link":
                    os.symlink(e.target, name, dir_fd=pfd)
                    os.utime(name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=pfd, follow_symlinks=False)
                elif e.kind == "fifo":
                    os.mkfifo(name, e.mode & _MODE_BITS, dir_fd=pfd)
                    os.utime(name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=pfd, follow_symlinks=False)
                else:
                    raise SnapshotError(f"snapshot {manifest.name} entry {e.path!r} has unknown kind {e.kind!r}")
            finally:
                os.close(pfd)
        # Directories last, deepest first: making their contents moved their mtimes, and a
        # read-only directory (mode 0o555) could not have been filled.
        for e in sorted(dirs, key=lambda d: d.path.count("/") + (d.path != ""), reverse=True):
            dfd = beneath.open_beneath(root_fd, e.path or ".", os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fchmod(dfd, e.mode & _MODE_BITS)
                os.utime(dfd, ns=(e.mtime_ns, e.mtime_ns))
            finally:
                os.close(dfd)

    def _read_blob(self, e: Entry) -> bytes:
        p = self.blob_path(e.sha256)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"blob {p} for {e.path!r} is missing from the store") from None
        if hashlib.sha256(data).hexdigest() != e.sha256:
            raise SnapshotError(f"blob {p} for {e.path!r} is damaged: its content does not hash to its name")
        return data


def _read_regular(parent_fd: int, name: str, st: os.stat_result, where: Path) -> bytes:
    """The bytes of the regular file the walk saw, or SnapshotError: a file swapped (for a
    link, a FIFO, another file) since the walk's stat is never read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapshotError(f"workspace file {where} became a link during the snapshot") from None
        raise SnapshotError(f"workspace file {where} cannot be read: {exc.strerror}") from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            raise SnapshotError(f"workspace file {where} was replaced during the snapshot")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if os.read(fd, 1):
            raise SnapshotError(f"workspace file {where} grew during the snapshot")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "device"
    return "other"


def _check_rel(path: str, name: str) -> None:
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in path:
        raise SnapshotError(f"snapshot {name} entry {path!r} is not a plain relative path")


def _remove(path: Path) -> None:
    """Remove a tree iteratively (``shutil.rmtree`` recurses, and a model can build a tree
    deeper than Python's recursion limit) or a single non-directory."""
    if os.path.isdir(path) and not os.path.islink(path):
        beneath.remove_tree(path)
    else:
        os.unlink(path)


def snapshot_due(call: int, every: int) -> bool:
    """Is a snapshot due after call ``call`` (0-based) at one per ``every`` calls?"""
    if every <= 0:
        raise ValueError(f"snapshot_every={every} must be > 0")
    return (call + 1) % every == 0



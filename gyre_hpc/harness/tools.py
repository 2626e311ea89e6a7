"""The workspace tools an agent acts through: read, write, append, list, run a command.

File tools run in the harness process (as root, in root mode), so every path is opened
through ``beneath``: resolved by the kernel beneath the workspace's directory fd in one step
(``openat2(RESOLVE_BENEATH)``), never checked first and opened later, so a symlink swapped in
by a concurrent process cannot send a read or a write outside. Only regular files with a
single link are read or written (a FIFO would block the harness, a hard link would alias a
file outside). Commands go through ``confine.run_confined``. A ToolError is reported to the
model as the tool's result, never raised out of the run: a bad path is the model's mistake.
"""
from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from gyre_hpc.harness import beneath
from gyre_hpc.harness.confine import CommandResult, CommandTooLong, Limits, run_confined, workspace_bytes


class ToolError(Exception):
    """A tool refused or failed; the message goes back to the model verbatim."""


def _shown(name: str) -> str:
    """A file name as the model sees it: bytes that are not UTF-8 (``os.listdir`` hands them
    over as lone surrogates, which no encoder of the tool result accepts) become U+FFFD."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


@dataclass
class Workspace:
    root: Path
    limits: Limits = field(default_factory=Limits)
    max_read_bytes: int = 2048
    max_list_entries: int = 64

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()

    @contextlib.contextmanager
    def _open(self, path: str, flags: int, create_parents: bool = False, missing: str = "no file"):
        """An fd for ``path`` beneath the workspace; every refusal becomes a ToolError naming it."""
        rel = path.strip()
        if os.path.isabs(rel):
            raise ToolError(f"path {path!r} is absolute: paths are relative to the workspace")
        # Lexically first, as a shell would read ``a/../b``; the kernel still guards every step.
        rel = posixpath.normpath(rel)
        if rel.split("/")[0] == "..":
            raise ToolError(f"path {path!r} leads outside the workspace")
        root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        fd = parent_fd = -1
        try:
            if create_parents and posixpath.dirname(rel):
                parent_fd = beneath.makedirs_beneath(root_fd, posixpath.dirname(rel))
                fd = beneath.open_beneath(parent_fd, posixpath.basename(rel), flags)
            else:
                fd = beneath.open_beneath(root_fd, rel, flags)
        except OSError as exc:
            if exc.errno in (errno.EXDEV, errno.ELOOP):
                raise ToolError(f"path {path!r} leads outside the workspace") from None
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise ToolError(f"{missing} {path!r} in the workspace") from None
            if exc.errno == errno.EISDIR:
                raise ToolError(f"{path!r} is a directory") from None
            raise ToolError(f"cannot open {path!r}: {exc.strerror}") from None
        finally:
            os.close(root_fd)
            if parent_fd >= 0:
                os.close(parent_fd)
        try:
            yield fd
        finally:
            os.close(fd)

    def read(self, path: str) -> bytes:
        with self._open(path, os.O_RDONLY | os.O_NONBLOCK) as fd:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ToolError(f"no file {path!r} in the workspace")
            if st.st_nlink > 1:
                raise ToolError(f"{path!r} has other hard links; not read")
            return os.read(fd, self.max_read_bytes)

    def write(self, path: str, data: bytes, append: bool = False) -> int:
        if not path.strip() or posixpath.normpath(path.strip()) in (".", "/"):
            raise ToolError(f"{path!r} is a directory")
        limit = self.limits.file_size_mb * 1024 * 1024
        # No O_TRUNC here: the size check and the type check come first, on the opened file.
        with self._open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, create_parents=True) as fd:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ToolError(f"{path!r} is not a regular file")
            if st.st_nlink > 1:
                raise ToolError(f"{path!r} has other hard links; not written")
            size = st.st_size if append else 0
            if size + len(data) > limit:
                raise ToolError(f"{path!r} would exceed the file size limit of {limit} bytes")
            quota = self.limits.workspace_mb * (1 << 20)
            held = workspace_bytes(self.root) - (0 if append else st.st_blocks * 512)
            if held + len(data) > quota:
                raise ToolError(f"writing {path!r} would take the workspace past its quota of "
                                f"{self.limits.workspace_mb} MiB (it holds {held / (1 << 20):.1f} MiB); delete files first")
            if append:
                os.lseek(fd, 0, os.SEEK_END)
            else:
                os.ftruncate(fd, 0)
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view):]
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise ToolError(f"cannot write {path!r}: {exc.strerror} (the disk is full)") from None
        return len(data)

    def list(self, path: str = ".") -> list[str]:
        """Relative paths of files under ``path`` (sorted, capped); links are not followed."""
        path = path or "."
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY, missing="no directory") as fd:
            prefix = posixpath.normpath(path.strip())
            prefix = "" if prefix == "." else prefix + "/"
            try:
                found = [prefix + _shown(rel) for rel, st, _, _ in beneath.walk(fd) if not stat.S_ISDIR(st.st_mode)]
            except RuntimeError as exc:
                raise ToolError(f"cannot list {path!r}: {exc}") from None
        return sorted(found)[: self.max_list_entries]

    def run(self, command: str, wall_s: float | None = None) -> CommandResult:
        limits = self.limits
        if wall_s is not None and wall_s < limits.wall_s:
            limits = replace(limits, wall_s=max(wall_s, 0.05))
        try:
            return run_confined(command, self.root, limits)
        except CommandTooLong as exc:
            raise ToolError(str(exc)) from None

"""The workspace tools an agent acts through: read, write, append, list, run a command.

File tools run in the harness process, so every path goes through
``confine.resolve_in_workspace`` (realpath, then a containment check); commands go
through ``confine.run_confined``. A ToolError is reported to the model as the tool's
result, never raised out of the run: a bad path is the model's mistake, not the harness's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from gyre_hpc.harness.confine import CommandResult, Limits, WorkspaceEscape, resolve_in_workspace, run_confined


class ToolError(Exception):
    """A tool refused or failed; the message goes back to the model verbatim."""


@dataclass
class Workspace:
    root: Path
    limits: Limits = field(default_factory=Limits)
    max_read_bytes: int = 2048
    max_list_entries: int = 64

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()

    def _resolve(self, path: str) -> Path:
        try:
            return resolve_in_workspace(self.root, path.strip())
        except WorkspaceEscape as exc:
            raise ToolError(str(exc)) from None

    def read(self, path: str) -> bytes:
        real = self._resolve(path)
        if not real.is_file():
            raise ToolError(f"no file {path!r} in the workspace")
        with open(real, "rb") as f:
            return f.read(self.max_read_bytes)

    def write(self, path: str, data: bytes, append: bool = False) -> int:
        real = self._resolve(path)
        if real == self.root or real.is_dir():
            raise ToolError(f"{path!r} is a directory")
        real.parent.mkdir(parents=True, exist_ok=True)
        limit = self.limits.file_size_mb * 1024 * 1024
        size = real.stat().st_size if append and real.exists() else 0
        if size + len(data) > limit:
            raise ToolError(f"{path!r} would exceed the file size limit of {limit} bytes")
        # O_NOFOLLOW: the resolved path has no symlink left; refuse one planted since.
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(real, flags, 0o644)
        except OSError as exc:
            raise ToolError(f"cannot write {path!r}: {exc.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return len(data)

    def list(self, path: str = ".") -> list[str]:
        """Relative paths of files under ``path`` (sorted, capped); links are not followed."""
        base = self._resolve(path or ".")
        if not base.is_dir():
            raise ToolError(f"no directory {path!r} in the workspace")
        found: list[str] = []
        for dirpath, _, filenames in os.walk(base):
            found.extend(os.path.relpath(os.path.join(dirpath, name), self.root) for name in filenames)
        return sorted(found)[: self.max_list_entries]

    def run(self, command: str, wall_s: float | None = None) -> CommandResult:
        limits = self.limits
        if wall_s is not None and wall_s < limits.wall_s:
            limits = replace(limits, wall_s=max(wall_s, 0.05))
        return run_confined(command, self.root, limits)

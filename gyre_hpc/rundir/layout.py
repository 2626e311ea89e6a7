"""Where things live inside a run directory; one place so no part guesses a path."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunDir:
    root: Path

    @classmethod
    def at(cls, path: str | Path) -> "RunDir":
        return cls(Path(path).resolve())

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def trees(self) -> Path:
        return self.root / "trees.zarr"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.h5"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files mirroring metrics.h5's steps and engines (metrics.tensorboard)."""
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def head_lock(self) -> Path:
        """Held (flock) by the one head that owns the directory; names it while held."""
        return self.root / "head.lock"

    @property
    def control(self) -> Path:
        """Files the supervisor drops to ask the fleet something (e.g. checkpoint and exit)."""
        return self.root / "control"

    @property
    def journals(self) -> Path:
        return self.root / "journals"

    @property
    def workspaces(self) -> Path:
        return self.root / "workspaces"

    def make(self) -> "RunDir":
        for d in (self.root, self.checkpoints, self.logs, self.control, self.journals, self.workspaces):
            d.mkdir(parents=True, exist_ok=True)
        return self

"""Where things live inside a run directory; one place so no part guesses a path."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Inside ``checkpoints/`` (``cells.checkpoint`` writes them; the head and ``inspect`` read them
# without importing the fleet's torch code): the pointer to the newest complete step directory,
# and the file that makes a step directory complete.
CHECKPOINT_LATEST = "latest"
CHECKPOINT_META = "meta.json"


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
    def exit_request(self) -> Path:
        """Dropped by the head to ask the fleet to checkpoint and exit (``contract.EXIT_CHECKPOINTED``)."""
        return self.control / "checkpoint-and-exit"

    @property
    def head_alive(self) -> Path:
        """The head's lease: its supervisor renews the mtime while the fleet runs, and a fleet
        whose lease is older than ``supervise.head_lease_s`` checkpoints and exits."""
        return self.control / "head-alive"

    @property
    def space_reserve(self) -> Path:
        """A few KiB the head sets aside at each start: a fleet that finds the disk full frees
        it to write ``disk_full`` (see ``rundir.disk_full``)."""
        return self.control / "space-reserve"

    @property
    def disk_full(self) -> Path:
        """The fleet's report of the write that found the disk full (file, space, rank)."""
        return self.control / "disk-full.json"

    @property
    def fleet_error(self) -> Path:
        """The first error a fleet rank died of (type, message, rank; ``rundir.fleet_error``)."""
        return self.control / "fleet-error.json"

    @property
    def journals(self) -> Path:
        return self.root / "journals"

    @property
    def workspaces(self) -> Path:
        return self.root / "workspaces"

    @property
    def snapshots(self) -> Path:
        """Each unfinished run's workspace snapshots (``harness.snapshot``), one store per run."""
        return self.root / "snapshots"

    def make(self) -> "RunDir":
        for d in (self.root, self.checkpoints, self.logs, self.control, self.journals, self.workspaces,
                  self.snapshots):
            d.mkdir(parents=True, exist_ok=True)
        return self

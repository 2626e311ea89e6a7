"""The asynchronous baseline: a fixed split of engines and replicas, bounded staleness.

Engines generate the next batch with weights up to ``max_staleness`` versions old while
the replicas train the previous one, so neither side waits for the other as long as the
split matches the work. The split never changes, so when the rollout tail leaves engines
idle (or the trainer outpaces the engines) that capacity is simply lost.

The staleness bound is not a role change: it gates when a new rollout batch may start
(see ``gyre_hpc.sched.staleness.may_start_rollout``), and the runtime and the simulator
both ask it through the policy's ``max_staleness``.
"""
from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.sched.state import CellKind, ClusterState, Role, RoleChange


@dataclass(frozen=True)
class AsyncSplitPolicy:
    # Cells that train, the core cell included (config: scheduler.async_train_cells). An
    # explicit input with no default: the split decides async's speed, and a split tuned
    # by the simulator is a different baseline from the one a user configures.
    train_cells: int
    max_staleness: int = 1

    def __post_init__(self) -> None:
        if self.train_cells < 1:
            raise ValueError(f"async train_cells={self.train_cells}: must be >= 1 (the core cell always trains)")
        if self.max_staleness < 0:
            raise ValueError(f"async max_staleness={self.max_staleness}: must be >= 0")

    def trainers(self, state: ClusterState) -> set[int]:
        """The fixed TRAIN set: the core cell(s), then the lowest-numbered elastic cells."""
        core = [c.cell for c in state.cells if c.kind is CellKind.CORE]
        elastic = sorted(c.cell for c in state.cells if c.kind is CellKind.ELASTIC)
        extra = self.train_cells - len(core)
        engines_left = len(state.cells) - len(core) - extra
        if extra > len(elastic) or engines_left < 1:
            raise ValueError(
                f"scheduler.async_train_cells={self.train_cells} cannot be met: the fleet has "
                f"{len(core)} core and {len(elastic)} elastic cells of {len(state.cells)}, and at least one "
                f"cell must stay an engine")
        return set(core) | set(elastic[:max(extra, 0)])

    def __call__(self, state: ClusterState) -> list[RoleChange]:
        train = self.trainers(state)
        changes = []
        for c in sorted(state.cells, key=lambda c: c.cell):
            if c.kind is not CellKind.ELASTIC or c.switching:
                continue
            want = Role.TRAIN if c.cell in train else Role.ROLLOUT
            if c.role is not want:
                changes.append(RoleChange(
                    c.cell, want, f"async split: {len(train)} of {len(state.cells)} cells train, the rest roll out"))
        return changes

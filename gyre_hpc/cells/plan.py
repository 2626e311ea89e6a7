"""Cells as the controller sees them: which world ranks form each cell, its kind and its role.

The world layout is fixed by the contract with the launchers: rank 0 is the controller and
cell ``c`` owns world ranks ``1 + c*rpc .. 1 + (c+1)*rpc - 1``. Nothing here assumes where
those ranks run (one host under mpiexec, het components under srun), so the same plan holds
everywhere. Pure data and functions so the role bookkeeping tests without processes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable, Mapping

from gyre_hpc.config import CellPlan
from gyre_hpc.sched.state import CellKind, Role

CONTROLLER_RANK = 0


@dataclass(frozen=True)
class Cell:
    id: int
    ranks: tuple[int, ...]
    kind: CellKind
    role: Role

    @property
    def leader(self) -> int:
        """The cell's first rank: it receives weights for the cell and speaks for it."""
        return self.ranks[0]


def world_size(plan: CellPlan) -> int:
    return 1 + plan.count * plan.ranks_per_cell


def cell_ranks(plan: CellPlan, cell: int) -> tuple[int, ...]:
    first = 1 + cell * plan.ranks_per_cell
    return tuple(range(first, first + plan.ranks_per_cell))


def cell_kind(plan: CellPlan, cell: int) -> CellKind:
    if cell == plan.core:
        return CellKind.CORE
    if cell in plan.rollout_only:
        return CellKind.ROLLOUT_ONLY
    return CellKind.ELASTIC


def plan_cells(plan: CellPlan, roles: Mapping[int, Role] | None = None) -> tuple[Cell, ...]:
    """The cells of a plan; ``roles`` (e.g. from a checkpoint) override the initial split.

    Initially the core cell and ``cells.initial_train`` train, every other cell rolls out.
    """
    initial = set(plan.initial_train or []) | {plan.core}
    cells = []
    for c in range(plan.count):
        kind = cell_kind(plan, c)
        role = Role.TRAIN if c in initial and kind is not CellKind.ROLLOUT_ONLY else Role.ROLLOUT
        cells.append(Cell(id=c, ranks=cell_ranks(plan, c), kind=kind, role=role))
    cells = tuple(cells)
    if roles:
        cells = with_roles(cells, roles)
    return cells


def with_roles(cells: tuple[Cell, ...], roles: Mapping[int, Role]) -> tuple[Cell, ...]:
    """Apply role changes, refusing the ones the cell's kind forbids (the message names the cell)."""
    by_id = {c.id: c for c in cells}
    for cid, role in roles.items():
        if cid not in by_id:
            raise ValueError(f"role change for cell {cid}: no such cell; cells are {sorted(by_id)}")
        role = Role(role)
        kind = by_id[cid].kind
        if kind is CellKind.CORE and role is not Role.TRAIN:
            raise ValueError(f"role change for cell {cid}: the core cell always trains")
        if kind is CellKind.ROLLOUT_ONLY and role is Role.TRAIN:
            raise ValueError(f"role change for cell {cid}: it is rollout-only (cells.rollout_only)")
        by_id[cid] = replace(by_id[cid], role=role)
    return tuple(by_id[c.id] for c in cells)


def core_cell(cells: Iterable[Cell]) -> Cell:
    for c in cells:
        if c.kind is CellKind.CORE:
            return c
    raise ValueError("the plan has no core cell")


def cell_of_rank(cells: Iterable[Cell], rank: int) -> Cell | None:
    """The cell a world rank belongs to; None for the controller."""
    for c in cells:
        if rank in c.ranks:
            return c
    return None


def train_ranks(cells: Iterable[Cell]) -> list[int]:
    """World ranks of the training communicator in its rank order: the core cell first, so
    train_comm rank 0 is the core cell's leader, the weight source."""
    cells = list(cells)
    core = core_cell(cells)
    others = sorted(r for c in cells if c.role is Role.TRAIN and c is not core for r in c.ranks)
    return list(core.ranks) + others

"""The communicators a fleet rank holds, re-derived from the cell plan after every flip.

Why carve communicators out of the world rather than ``Spawn`` or a fixed layout: under
``srun --mpi=pmix`` the world is fixed per step, so the only way to let cells move between
roles is to derive new communicators from the one world.

The fixed ones (one per cell, all cells) are made once at start with ``Comm.Split``, which
every world rank calls. The ones a flip changes (``train_comm``, the weight-transfer comm)
use ``Comm.Create_group``, collective over the members only: the controller and the cells
a flip does not concern go on with their work instead of waking for a world-wide collective,
which on a loaded or oversubscribed node costs more than the flip itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from mpi4py import MPI

from gyre_hpc.cells.plan import Cell, cell_of_rank, core_cell, train_ranks


def split_cell_comm(world: MPI.Intracomm, cells: Iterable[Cell]) -> MPI.Intracomm | None:
    """One communicator per cell (intra-cell weight fan-out, tensor/data parallel inside a cell)."""
    me = cell_of_rank(cells, world.Get_rank())
    color = MPI.UNDEFINED if me is None else me.id
    comm = world.Split(color, world.Get_rank())
    return None if comm == MPI.COMM_NULL else comm


def split_train_comm(world: MPI.Intracomm, cells: Iterable[Cell]) -> MPI.Intracomm | None:
    """The training communicator derived by every world rank at once (fleet start).

    Same members and order as ``create_train_comm``; flips use that one, since it leaves
    the ranks outside the new communicator alone.
    """
    order = train_ranks(cells)
    rank = world.Get_rank()
    color = 0 if rank in order else MPI.UNDEFINED
    comm = world.Split(color, order.index(rank) if rank in order else 0)
    return None if comm == MPI.COMM_NULL else comm


TAG_TRAIN_COMM = 101
TAG_JOIN_COMM = 102


def create_comm(world: MPI.Intracomm, members: list[int], tag: int) -> MPI.Intracomm | None:
    """A communicator of exactly ``members`` in that rank order; only members may call it."""
    if world.Get_rank() not in members:
        return None
    world_group = world.Get_group()
    group = world_group.Incl(members)
    try:
        return world.Create_group(group, tag)
    finally:
        group.Free()
        world_group.Free()


def create_train_comm(world: MPI.Intracomm, cells: Iterable[Cell]) -> MPI.Intracomm | None:
    """The training communicator: exactly the ranks of TRAIN cells, core cell leader as rank 0.

    Every rank of a TRAIN cell must call it; other ranks get None without communicating.
    """
    return create_comm(world, train_ranks(cells), TAG_TRAIN_COMM)


def create_join_comm(world: MPI.Intracomm, source: int, joiners: Iterable[int]) -> MPI.Intracomm | None:
    """Weight source plus the leaders of cells joining TRAIN; the source is rank 0.

    Only joiners receive bytes: cells already training hold the same weights, so sending to
    the whole train_comm would move the state dict again for nothing.
    """
    joiners = sorted(set(joiners) - {source})
    if not joiners:
        return None
    return create_comm(world, [source] + joiners, TAG_JOIN_COMM)


def split_cells_comm(world: MPI.Intracomm, cells: Iterable[Cell]) -> MPI.Intracomm | None:
    """Every cell rank, without the controller; core leader first (the startup weight broadcast)."""
    cells = list(cells)
    core = core_cell(cells)
    members = list(core.ranks) + sorted(r for c in cells if c is not core for r in c.ranks)
    rank = world.Get_rank()
    color = 0 if rank in members else MPI.UNDEFINED
    comm = world.Split(color, members.index(rank) if rank in members else 0)
    return None if comm == MPI.COMM_NULL else comm


def world_ranks_of(comm: MPI.Intracomm, world: MPI.Intracomm) -> list[int]:
    """World ranks of a communicator's members, in the communicator's rank order."""
    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world.Get_group()))


def free(comm: MPI.Intracomm | None) -> None:
    if comm is not None and comm != MPI.COMM_NULL:
        comm.Free()


@dataclass
class RankComms:
    """What one cell rank holds; ``train`` is None while its cell rolls out."""

    world: MPI.Intracomm
    cell: MPI.Intracomm
    train: MPI.Intracomm | None

    def rederive_train(self, cells: Iterable[Cell]) -> None:
        free(self.train)
        self.train = create_train_comm(self.world, cells)

    def train_members(self) -> tuple[int, ...] | None:
        """The world ranks this rank reduces gradients over (None outside TRAIN): what the
        controller checks against its role table after a flip or a meeting."""
        return tuple(world_ranks_of(self.train, self.world)) if self.train is not None else None


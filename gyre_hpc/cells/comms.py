"""The communicators a fleet rank holds, re-derived from the cell plan after every flip.

Why ``Comm.Split`` over the world rather than ``Spawn`` or a fixed layout: under
``srun --mpi=pmix`` the world is fixed per step, so the only way to let cells move between
roles is to carve new communicators out of the one world. Split is collective over the
world, so every rank, the controller included, calls each function here at the same point
of the command loop (the controller passes ``MPI.UNDEFINED`` and gets nothing back).
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
    """The training communicator: exactly the ranks of TRAIN cells, core cell leader as rank 0."""
    order = train_ranks(cells)
    rank = world.Get_rank()
    color = 0 if rank in order else MPI.UNDEFINED
    key = order.index(rank) if rank in order else 0
    comm = world.Split(color, key)
    return None if comm == MPI.COMM_NULL else comm


def split_join_comm(world: MPI.Intracomm, source: int, joiners: Iterable[int]) -> MPI.Intracomm | None:
    """Weight source plus the leaders of cells joining TRAIN; the source is rank 0.

    Only joiners receive bytes: cells already training hold the same weights, so sending to
    the whole train_comm would move the state dict again for nothing.
    """
    joiners = sorted(set(joiners) - {source})
    members = [source] + joiners
    rank = world.Get_rank()
    color = 0 if rank in members and joiners else MPI.UNDEFINED
    key = members.index(rank) if rank in members else 0
    comm = world.Split(color, key)
    return None if comm == MPI.COMM_NULL else comm


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
        self.train = split_train_comm(self.world, cells)


"""One cell rank: the one serve loop that executes the controller's commands.

A rank holds full weights and the communicators of ``comms``. Roles change only at a Flip
command, which every rank of the world handles at the same point, so the Splits and the
weight broadcast line up. The fleet's commands (flip, checkpoint, stop) are handled here,
through the narrow ``rank_state.RankState``; a workload's own commands (RL: serve the
engine, train a micro-batch, finish the step; the substrate: its rounds) go to its
``RankHandler``, which answers through ``reply`` like everything else.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from mpi4py import MPI

from typing import Protocol

from gyre_hpc.cells import comms, protocol, weights
from gyre_hpc.cells.plan import Cell, cell_of_rank, core_cell, with_roles
from gyre_hpc.cells.rank_state import RankState
from gyre_hpc.sched.state import Role


class RankHandler(Protocol):
    def handle(self, rank: "CellRank", cmd) -> object | None:
        """Answer a workload command; return the reply (None: the handler replied itself, via
        ``rank.reply``, before doing long work such as serving an engine). Raise TypeError
        for a command it does not know."""


@dataclass
class CellRank:
    world: MPI.Intracomm
    cells: tuple[Cell, ...]
    workload: RankState
    rank_comms: comms.RankComms
    chunk_bytes: int = weights.DEFAULT_CHUNK_BYTES
    handler: RankHandler | None = None
    _stop: int | None = field(default=None, init=False)

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def cell(self) -> Cell:
        return cell_of_rank(self.cells, self.rank)

    def serve(self) -> int:
        """Run commands until Stop; returns the exit code the controller chose."""
        while self._stop is None:
            cmd = protocol.wait_command(self.world)
            reply = self.handle(cmd)
            if reply is not None:
                self.reply(reply)
        return self._stop

    def reply(self, msg) -> None:
        """The answer to the command in hand (every command but Stop owes exactly one)."""
        self.world.send(msg, dest=0, tag=protocol.TAG_REPLY)

    def handle(self, cmd):
        if isinstance(cmd, protocol.Flip):
            return self.flip(cmd)
        if isinstance(cmd, protocol.SaveCheckpoint):
            if self.rank == core_cell(self.cells).leader:
                self.workload.save(cmd.directory, cmd.extra)
            return protocol.Ack(self.rank)
        if isinstance(cmd, protocol.Stop):
            self._stop = cmd.code
            return None
        if self.handler is not None:
            return self.handler.handle(self, cmd)
        raise TypeError(f"cell rank {self.rank}: unknown command {type(cmd).__name__}")

    def flip(self, cmd: protocol.Flip) -> protocol.FlipReport:
        t0 = time.perf_counter()
        old = _with_table(self.cells, cmd.before)
        new = _with_table(old, cmd.changes)
        if cmd.in_place:
            return self._join_in_place(cmd, new, t0)
        joining = [c for c in new if c.role is Role.TRAIN and cell_of_rank(old, c.leader).role is not Role.TRAIN]
        self.cells = new
        self.rank_comms.rederive_train(new)
        source = core_cell(new).leader
        join_comm = comms.create_join_comm(self.world, source, [c.leader for c in joining])
        t_comm = time.perf_counter()
        received = 0
        me_joining = any(c.id == self.cell.id for c in joining)
        if join_comm is not None:
            # Receive straight into the model's tensors: no second copy of the weights.
            weights.bcast_into(self.workload.state_dict(), join_comm, chunk_bytes=self.chunk_bytes)
            comms.free(join_comm)
            if self.rank != source:
                received = weights.state_bytes(self.workload.state_dict())
        if me_joining and self.rank_comms.cell.Get_size() > 1:
            weights.bcast_into(self.workload.state_dict(), self.rank_comms.cell, chunk_bytes=self.chunk_bytes)
            if self.rank != self.cell.leader:
                received = weights.state_bytes(self.workload.state_dict())
        t_transfer = time.perf_counter()
        was_training = cell_of_rank(old, self.rank).role is Role.TRAIN
        if was_training != (self.cell.role is Role.TRAIN):
            # Joining or leaving mid-step: this rank's partial gradients are not part of the
            # step any more (the controller hands its micro-batches to the remaining replicas).
            self.workload.zero_grads()
        members = self.rank_comms.train_members()
        touched = any(c == self.cell.id for c, _ in cmd.changes) or self.rank == source
        checksum = weights.state_checksum(self.workload.state_dict()) if cmd.checksums and touched else None
        return protocol.FlipReport(rank=self.rank, cell=self.cell.id, seconds=time.perf_counter() - t0,
                                   comm_s=t_comm - t0, transfer_s=t_transfer - t_comm,
                                   bytes_in=received, train_members=members, checksum=checksum)

    def _join_in_place(self, cmd: protocol.Flip, new: tuple[Cell, ...], t0: float) -> protocol.FlipReport:
        """Join TRAIN with the state this rank holds (``protocol.Flip.in_place``): its
        train_comm waits for ``meet_train``."""
        if self.rank_comms.train is not None:
            raise RuntimeError(f"rank {self.rank}: in-place join while it holds a train_comm")
        cell = cell_of_rank(new, self.rank).id
        held = self.workload.weights_version() if cell in cmd.weights_only else self.workload.applied_updates()
        check_in_place(cell, self.rank, held, cmd.updates)
        self.cells = new
        self.workload.zero_grads()
        checksum = weights.state_checksum(self.workload.state_dict()) if cmd.checksums else None
        return protocol.FlipReport(rank=self.rank, cell=self.cell.id, seconds=time.perf_counter() - t0,
                                   comm_s=0.0, transfer_s=0.0, bytes_in=0, train_members=None, checksum=checksum)

    def meet_train(self, roles: tuple[tuple[int, str], ...]) -> tuple[int, ...] | None:
        """Every TRAIN rank, together: take the controller's role table and re-derive
        train_comm (after joins in place). Returns the members as this rank now holds them."""
        self.cells = _with_table(self.cells, roles)
        self.rank_comms.rederive_train(self.cells)
        return self.rank_comms.train_members()


def check_in_place(cell: int, rank: int, held: int, expected: int) -> None:
    """Refuse a join in place on a state the core has moved past: the controller chose it
    from its bookkeeping of who applied the last update, and a wrong entry would average this
    rank's gradients on stale weights into the step with no error anywhere. Failing here stops
    the fleet, whose relaunch resumes from the last checkpoint (``expected`` -1: unchecked)."""
    if expected >= 0 and held != expected:
        raise RuntimeError(f"cell {cell} rank {rank}: told to join TRAIN in place with the core's state after "
                           f"{expected} optimizer updates, but it holds {held}: the controller's record of "
                           f"which cells applied the last update is wrong")


def _with_table(cells: tuple[Cell, ...], table: tuple[tuple[int, str], ...]) -> tuple[Cell, ...]:
    """``cells`` with the roles of a wire table ((cell id, role value) pairs)."""
    return with_roles(cells, {c: Role(r) for c, r in table})

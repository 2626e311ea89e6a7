"""The fleet protocol's messages: the controller sends commands, the cell rank replies.

Small frozen dataclasses pickled over MPI point-to-point (they are tiny; bulk bytes move
with buffer-based collectives in ``weights``/``gradsync``). Every command owes exactly one
reply (``Stop`` none), so the controller always knows the command was seen, the collectives
that follow line up, and a silent rank is found by its reply timeout. Workloads add their
own commands (``gyre_hpc.rl.messages``, ``gyre_hpc.substrate.messages``); they travel the same way and are answered by the
workload's rank handler inside the one serve loop of ``cell_rank``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

TAG_COMMAND = 11
TAG_REPLY = 12


# ---- commands ------------------------------------------------------------------------
@dataclass(frozen=True)
class Flip:
    step: int
    changes: tuple[tuple[int, str], ...]   # (cell, Role value)
    checksums: bool = False                # joiners/leavers report a state checksum (tests)
    # Every cell's role before the flip. Engines that take no part in a flip keep decoding
    # and miss it; whichever Flip reaches them next brings their role table up to date.
    before: tuple[tuple[int, str], ...] = ()
    # Joiners that hold the core's state already (they applied the last update): no weights
    # move, only they take part, and the TRAIN ranks re-derive train_comm when they next meet.
    in_place: bool = False
    # The optimizer updates the core's state has applied (the controller's policy version):
    # an in-place joiner must hold exactly as many, or it would train on a state the core left
    # behind (its gradients averaged into the step without an error). -1: not checked.
    updates: int = -1
    # Joiners in place that hold the core's weights but not its optimizer moments (engines
    # sent the last update's weights, which never applied it): checked against ``updates`` by
    # the version of their weights; they add gradients to the step and take the updated
    # weights from the core at its allreduce instead of applying the update.
    weights_only: tuple[int, ...] = ()


@dataclass(frozen=True)
class SaveCheckpoint:
    """The core cell's ranks write their workload's state into ``directory`` (the leader)."""

    step: int
    directory: str
    extra: dict | None = None              # written into the HF config by workloads that have one


@dataclass(frozen=True)
class Stop:
    code: int


# ---- replies -------------------------------------------------------------------------
@dataclass(frozen=True)
class FlipReport:
    rank: int
    cell: int
    seconds: float                          # command received -> ready in the new role
    comm_s: float                           # of which: re-deriving train_comm and the join comm
    transfer_s: float                       # of which: receiving (or sending) the weights
    bytes_in: int
    train_members: tuple[int, ...] | None   # world ranks of train_comm as this rank sees it
    checksum: str | None = None


@dataclass(frozen=True)
class Ack:
    rank: int


def wait_command(world: MPI.Intracomm, source: int = 0):
    """Block for the next command without spinning a core.

    Why not a plain ``recv``: Open MPI busy-polls inside blocking calls, and an idle cell
    rank (a rollout cell waiting for the step to end) would burn a whole core doing it.
    """
    pause = 0.0002
    while not world.Iprobe(source=source, tag=TAG_COMMAND):
        time.sleep(pause)
        pause = min(pause * 2, 0.005)
    return world.recv(source=source, tag=TAG_COMMAND)

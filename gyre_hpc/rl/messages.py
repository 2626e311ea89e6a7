"""The RL fleet's own commands and replies, beside the substrate's ``cells.protocol``.

They travel on the same world tags (``TAG_COMMAND`` down, ``TAG_REPLY`` up) and a cell rank
handles them in the same loop as ``protocol.Flip`` and ``protocol.Stop``, so the flip
machinery of ``gyre_hpc.cells`` is used unchanged. Micro-batches are pickled: packed rows of a
tiny model are kilobytes; weights move with the chunked broadcasts of ``cells.weights``.
"""
from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.rl.trainer import MicroBatch


@dataclass(frozen=True)
class Serve:
    """ROLLOUT rank: serve the engine (``serve_engine``) until the controller pauses it."""

    policy_version: int


@dataclass(frozen=True)
class Train:
    micro_batch: MicroBatch


@dataclass(frozen=True)
class Finish:
    """TRAIN ranks: allreduce the step's gradients, divide by ``n_runs``, optimizer step."""

    step: int
    n_runs: int
    policy_version: int     # the version the update produces
    checksums: bool = False


@dataclass(frozen=True)
class SaveRL:
    directory: str
    extra: dict


@dataclass(frozen=True)
class TrainReport:
    rank: int
    step: int
    mb_id: int
    loss: float
    tokens: int
    seconds: float


@dataclass(frozen=True)
class FinishReport:
    rank: int
    seconds: float
    replicas: float                 # total weight of the allreduce: replicas that took part
    state: dict | None = None       # the core leader's new model weights, for the engines
    checksum: str | None = None

"""The RL workload's commands and replies, on top of the fleet protocol (``cells.protocol``).

They go out through the controller's ``send``/``broadcast`` and each owes one reply like any
fleet command; the cell rank's one serve loop hands them to ``rl.rank.RLRankHandler``. A micro-batch travels as store indices
(``MicroBatchRef``): the replica reads the trees from ``trees.zarr``; weights move with the
chunked broadcasts of ``cells.weights``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gyre_hpc.rl.batches import MicroBatchRef
from gyre_hpc.trees.loss import LogprobGap


@dataclass(frozen=True)
class Serve:
    """ROLLOUT rank: serve the engine (``serve_engine``) until the controller pauses it."""

    policy_version: int


@dataclass(frozen=True)
class Train:
    micro_batch: MicroBatchRef      # store indices of the group, not the trees
    # TRAIN ranks when dealt: a paced replica's data-parallel rate (a joiner in place holds
    # no train_comm to count them until the step's Finish)
    replicas: int = 1

    @property
    def step(self) -> int:
        return self.micro_batch.step


@dataclass(frozen=True)
class Finish:
    """TRAIN ranks: allreduce the step's gradients, divide by ``n_runs``, optimizer step."""

    step: int
    n_runs: int
    policy_version: int     # the version the update produces
    checksums: bool = False
    # Every cell's role, when cells joined TRAIN in place this step: the TRAIN ranks
    # re-derive train_comm together before the allreduce (``CellRank.meet_train``).
    roles: tuple[tuple[int, str], ...] = ()
    # Some TRAIN ranks hold the weights without the moments (weights-only joins): after the
    # allreduce the core leader broadcasts the updated weights over train_comm to all of them.
    weights_from_core: bool = False


@dataclass(frozen=True)
class PushWeights:
    """Core leader: broadcast the new weights to ``members[1:]`` (serving engines' ranks)."""

    step: int
    policy_version: int
    members: tuple[int, ...]


@dataclass(frozen=True)
class WeightsReport:
    rank: int
    seconds: float
    bytes: int


@dataclass(frozen=True)
class TrainReport:
    rank: int
    step: int
    mb_id: int
    loss: float
    tokens: int
    seconds: float
    gap: LogprobGap = field(default_factory=LogprobGap)   # trainer vs behaviour logprobs of its targets
    pace: dict | None = None    # a paced replica's record so far (emulated durations, overruns)
    peak_rss_kib: int = 0       # the replica process's peak resident memory so far (ru_maxrss)


@dataclass(frozen=True)
class FinishReport:
    rank: int
    seconds: float
    replicas: float                 # total weight of the allreduce: replicas that took part
    checksum: str | None = None     # weights and moments (None on a rank that holds the weights alone)
    train_members: tuple[int, ...] | None = None   # train_comm re-derived by Finish.roles
    weights_checksum: str | None = None

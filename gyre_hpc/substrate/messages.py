"""The substrate workload's commands and replies, on top of ``cells.protocol``.

A step is cut into rounds so the controller regains control between them (a flip may land
mid-step); they travel like every fleet command and are answered by ``rank.SubstrateRankHandler``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BeginStep:
    step: int


@dataclass(frozen=True)
class Round:
    step: int
    round: int
    assign: dict[int, tuple[int, ...]]     # world rank -> micro-batch ids (TRAIN ranks only)


@dataclass(frozen=True)
class AbortStep:
    step: int


@dataclass(frozen=True)
class EndStep:
    step: int
    micro_batches: int
    checksums: bool = False


@dataclass(frozen=True)
class RoundReport:
    rank: int
    losses: dict[int, float]                # micro-batch id -> loss
    tokens: int
    rollout_tokens: int
    seconds: float


@dataclass(frozen=True)
class EndReport:
    rank: int
    seconds: float
    checksum: str | None = None

"""Paced cells: real compute held to the device model's duration (design.md section 7).

An emulated device: the work is done for real (tokens, KV, gradients), then the cell waits
until the duration the device model gives for that work has passed on its own clock, so a
cell that shares cores with others still has the capacity of the device it stands for.
Where the real compute took longer than the model, nothing can be held: that interval is
an overrun, recorded, and a run whose overrun share is high is not a valid emulation.
Every duration this produces is EMULATED; reports that use it say so.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from gyre_hpc.devices import EngineModel, TrainModel


@dataclass
class PaceRecord:
    """What a paced cell held, cumulative. Durations are emulated."""
    intervals: int = 0
    paced_s: float = 0.0        # the device model's durations (what the cell took)
    real_s: float = 0.0         # real compute inside them
    overruns: int = 0           # intervals whose real compute exceeded the model
    overrun_s: float = 0.0      # by how much, in all

    @property
    def overrun_share(self) -> float:
        return self.overrun_s / self.paced_s if self.paced_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {"emulated": True, "intervals": self.intervals, "paced_s": round(self.paced_s, 6),
                "real_s": round(self.real_s, 6), "overruns": self.overruns, "overrun_s": round(self.overrun_s, 6),
                "overrun_share": round(self.overrun_share, 6)}


@dataclass
class Pacer:
    """Holds each piece of work to ``target / speed`` seconds from its start."""
    speed: float = 1.0           # this cell's device against the model's (0.7: 30% slower)
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    record: PaceRecord = field(default_factory=PaceRecord)

    def __post_init__(self) -> None:
        if self.speed <= 0:
            raise ValueError(f"pace speed={self.speed}: must be > 0")

    def hold(self, started: float, target_s: float) -> float:
        """Wait until ``target_s / speed`` has passed since ``started``; returns the
        interval's emulated duration (the target, or the real time where it overran)."""
        target = target_s / self.speed
        real = self.clock() - started
        r = self.record
        r.intervals += 1
        r.real_s += real
        if real > target:
            r.overruns += 1
            r.overrun_s += real - target
            r.paced_s += real
            return real
        self.sleep(target - real)
        r.paced_s += target
        return target


@dataclass
class EnginePace:
    """A paced engine's device and pacer."""
    model: EngineModel
    pacer: Pacer

    def step_s(self, decoding: int, kv_tokens: int, prefills: list[tuple[int, int]]) -> float:
        """The device's duration of one engine step: a decode step of ``decoding`` sequences
        holding ``kv_tokens`` KV tokens, and each prefill ``(new, cached)`` it did
        (``EngineModel.batch_step_s``)."""
        return self.model.batch_step_s(decoding, kv_tokens, prefills)


@dataclass
class TrainPace:
    """A paced replica's device and pacer."""
    model: TrainModel
    pacer: Pacer

    def micro_batch_s(self, tokens: int, replicas: int) -> float:
        return self.model.train_s(tokens, replicas)

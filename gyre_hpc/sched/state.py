"""What a scheduler policy sees and what it may decide.

Policies are pure functions ``ClusterState -> list[RoleChange]`` so the runtime controller
and the simulator call the very same code: each builds a ``ClusterState`` from what it
observed (real counters or simulated ones) and applies the changes it gets back.
New observations are added as fields with defaults so existing callers keep working.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable


class Role(str, Enum):
    ROLLOUT = "ROLLOUT"
    TRAIN = "TRAIN"


class CellKind(str, Enum):
    CORE = "core"              # always TRAIN, holds the authoritative weights
    ELASTIC = "elastic"        # may flip between ROLLOUT and TRAIN
    ROLLOUT_ONLY = "rollout"   # never trains


@dataclass(frozen=True)
class CellState:
    cell: int
    kind: CellKind
    role: Role
    switching: bool = False           # a flip is in progress; the policy must not flip it again
    inflight_requests: int = 0        # requests being decoded on this cell's engine
    inflight_tokens: int = 0          # KV tokens held by those requests
    rollout_tokens_per_s: float = 0.0  # measured decode throughput as an engine
    train_tokens_per_s: float = 0.0    # measured training throughput as a replica
    # In-flight requests on this engine that belong to the runs expected to finish last
    # (the caller ranks unfinished runs by expected remaining time and marks the top ones).
    # A release must leave those runs a lightly loaded engine: the tail sets the step time.
    tail_requests: int = 0
    kv_capacity_tokens: int = 0        # KV-cache tokens this engine can hold (0 = unknown)
    # The cell holds the core's optimizer moments (it applied the last update; at a launch every
    # cell does). False: released, it joins weights only and takes the core's new weights at
    # every update it trains for, a broadcast the step's end waits on (paper-local, paced: the
    # update took 0.6-1.1 s with one such joiner, 0.4-0.5 s with a joiner that held the moments).
    holds_moments: bool = True


@dataclass(frozen=True)
class ClusterState:
    time: float
    step: int
    cells: tuple[CellState, ...]
    unfinished_runs: int = 0          # harness runs of every launched rollout batch not yet done
    queued_requests: int = 0          # model calls waiting for an engine
    inflight_requests: int = 0
    tokens_inflight: int = 0
    train_backlog_tokens: int = 0     # trajectory tokens stored but not yet trained
    # Training tokens the unfinished runs are expected to add once they finish (the caller's
    # measure per finished run x unfinished runs; 0 = unknown). Work a released cell will
    # find before the batch ends, beside the backlog already waiting.
    expected_train_tokens: int = 0
    policy_version: int = 0           # trainer's newest weights
    oldest_rollout_version: int = 0   # policy version of the oldest unfinished run
    # How long queued work has continuously exceeded what the serving engines hold, as the
    # caller measured it (wall clock in the runtime, simulated time in the simulator), taken
    # *after* the caller dispatched what it could: a call queued for the instant before
    # dispatch is not demand. Reclaims need this to reach the policy's hysteresis interval.
    demand_over_capacity_s: float = 0.0
    # Runs still unfinished whose requests the caller counts as the tail (see tail_requests).
    tail_runs: int = 0
    # No run can start before the trainer's next update: every launched run has started and
    # the staleness bound holds the next batch back (or no batch is left). Off-policy, the
    # open runs are then all the engines will serve until the running step ends. False: a
    # batch may start at any moment (or the caller does not know).
    next_batch_waits: bool = False
    rollout_to_train_s: float = 8.5   # measured (or configured) switch costs
    train_to_rollout_s: float = 3.5

    def cell(self, idx: int) -> CellState:
        for c in self.cells:
            if c.cell == idx:
                return c
        raise KeyError(f"no cell {idx}; cells are {[c.cell for c in self.cells]}")

    def in_role(self, role: Role) -> list[CellState]:
        return [c for c in self.cells if c.role is role]


@dataclass(frozen=True)
class RoleChange:
    cell: int
    to: Role
    reason: str = ""


Policy = Callable[[ClusterState], list[RoleChange]]

"""The colocated baseline: every elastic cell rolls out, then every elastic cell trains.

This is the synchronous schedule most RL frameworks run: the whole fleet generates the
batch, then the whole fleet trains on it. The rollout tail therefore idles every engine
but the few still decoding.

The core cell is the one exception and stays TRAIN throughout: it holds the authoritative
weights and optimizer state, and sending it to decode would mean moving that state off
and back every step. During the rollout phase it trains whatever advantage groups are
already complete (the same streaming the elastic policy uses), which with the >= 64
cells of the paper's regime is 1/64 of the fleet. A fleet whose only trainer is the core
cell is thus an honest colocated baseline with one trainer that never idles.
"""
from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.sched.capacity import flippable
from gyre_hpc.sched.state import ClusterState, Role, RoleChange


@dataclass(frozen=True)
class ColocatePolicy:
    max_staleness: int = 0  # colocated RL is on-policy: a batch waits for the newest weights

    def __call__(self, state: ClusterState) -> list[RoleChange]:
        rollout_phase = state.unfinished_runs > 0 or state.queued_requests > 0 or state.inflight_requests > 0
        if rollout_phase:
            phase, why = Role.ROLLOUT, f"{state.unfinished_runs} runs unfinished: everyone rolls out"
        elif state.train_backlog_tokens > 0:
            phase, why = Role.TRAIN, f"batch done, {state.train_backlog_tokens} tokens to train: everyone trains"
        else:
            return []  # between steps with nothing to do: stay put, a flip would only cost
        other = Role.TRAIN if phase is Role.ROLLOUT else Role.ROLLOUT
        return [RoleChange(c.cell, phase, why) for c in sorted(flippable(state, other), key=lambda c: c.cell)]

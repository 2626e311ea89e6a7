"""The elastic policy: engines that the rollout tail no longer needs train instead.

Long-horizon agent runs have heavy-tailed durations, so late in a rollout batch a few
runs keep the batch open while most engines sit idle. Finished runs (their whole
advantage group, in fact) are already trainable, so those idle engines are released to
the training communicator and train the backlog while the tail finishes; when the next
batch queues requests, idle replicas are reclaimed as engines.

Release and reclaim use different thresholds (``fill`` < 1) so a cell released because
the work fits is not reclaimed by the very next decision.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gyre_hpc.sched.capacity import (
    arriving_engines, flippable, rollout_demand, serving_engines, train_rate, trainers_rate,
)
from gyre_hpc.sched.state import ClusterState, Role, RoleChange


@dataclass(frozen=True)
class ElasticParams:
    # Requests one engine holds while each sequence still decodes near its single-sequence
    # speed. Past it, batching makes every sequence slower, and the tail runs (the ones that
    # set the step time) are exactly the ones that would pay. The simulator derives it from
    # its throughput curve; a real fleet sets it from the engine benchmark.
    target_requests_per_engine: int = 16
    # KV-cache tokens one engine holds; when set (> 0), release only while the tokens in
    # flight fit the remaining engines at `fill` of it, since migrated sequences bring their
    # KV cache along. 0: engines report no KV capacity, requests are the only measure.
    kv_tokens_per_engine: int = 0
    # Release only while the remaining engines would be at most this full (of the target):
    # headroom for runs coming back from a tool call, and the gap that stops flapping.
    fill: float = 0.8
    # Release only if it shortens the training of the waiting backlog by more than this
    # many switches back (train->rollout): the cells arrive after rollout_to_train_s, and
    # must return before the next batch. A backlog the replicas finish alone before the
    # switch would end is never worth a release.
    return_cost_weight: float = 1.0
    # Reclaim replicas for waiting rollout work only while the training backlog would take
    # the current replicas less than this long: a large backlog means they are not idle.
    reclaim_backlog_s: float = 30.0
    # Training tokens/s assumed for a cell that has never trained (its figure is 0).
    default_train_tokens_per_s: float = 1.0
    # Versions a rollout may lag the trainer; elastic is on-policy.
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.kv_tokens_per_engine < 0:
            raise ValueError(f"elastic kv_tokens_per_engine={self.kv_tokens_per_engine}: must be >= 0 (0 = unchecked)")
        if self.target_requests_per_engine < 1:
            raise ValueError(f"elastic target_requests_per_engine={self.target_requests_per_engine}: must be >= 1")
        if not 0 < self.fill <= 1:
            raise ValueError(f"elastic fill={self.fill}: must be in (0, 1]")
        if self.return_cost_weight < 0 or self.reclaim_backlog_s < 0:
            raise ValueError("elastic return_cost_weight and reclaim_backlog_s must be >= 0")
        if self.default_train_tokens_per_s <= 0:
            raise ValueError(f"elastic default_train_tokens_per_s={self.default_train_tokens_per_s}: must be > 0")
        if self.max_staleness < 0:
            raise ValueError(f"elastic max_staleness={self.max_staleness}: must be >= 0")


@dataclass(frozen=True)
class ElasticPolicy:
    params: ElasticParams = ElasticParams()

    @property
    def max_staleness(self) -> int:
        return self.params.max_staleness

    def __call__(self, state: ClusterState) -> list[RoleChange]:
        changes = self._reclaim(state)
        if changes:
            return changes
        return self._release(state)

    def _reclaim(self, state: ClusterState) -> list[RoleChange]:
        p = self.params
        demand = rollout_demand(state)
        engines = len(arriving_engines(state))
        if state.queued_requests == 0 and demand <= p.target_requests_per_engine * engines:
            return []
        candidates = flippable(state, Role.TRAIN)
        if not candidates or demand == 0:
            return []
        rate = trainers_rate(state, p.default_train_tokens_per_s)
        backlog_s = state.train_backlog_tokens / rate if rate > 0 else math.inf
        # Highest id first: the order is fixed so that replays of a run decide the same way.
        candidates = sorted(candidates, key=lambda c: -c.cell)
        if backlog_s <= p.reclaim_backlog_s:
            # The replicas have (almost) nothing to train: every one of them is better used
            # as an engine, where it lowers each engine's batch and so speeds every run.
            picked = candidates
            why = f"rollout demand {demand} > {engines} engines x {p.target_requests_per_engine}, backlog {backlog_s:.0f}s"
        else:
            need = math.ceil(demand / p.target_requests_per_engine) - engines
            picked = candidates[:max(need, 0)]
            why = f"rollout demand {demand} needs {need} more engines; backlog {backlog_s:.0f}s keeps the rest"
        return [RoleChange(c.cell, Role.ROLLOUT, why) for c in picked]

    def _release(self, state: ClusterState) -> list[RoleChange]:
        p = self.params
        if state.queued_requests > 0:
            return []
        demand = rollout_demand(state)
        engines = len(serving_engines(state))
        # Fewest in-flight requests first (least KV to migrate), then highest id.
        candidates = sorted(flippable(state, Role.ROLLOUT), key=lambda c: (c.inflight_requests, -c.cell))
        picked = []
        for c in candidates:
            after = engines - 1
            if state.unfinished_runs > 0 and after < 1:
                break  # the last engine stays while any run can still call the model
            if demand > p.fill * p.target_requests_per_engine * after:
                break
            if p.kv_tokens_per_engine and state.tokens_inflight > p.fill * p.kv_tokens_per_engine * after:
                break
            picked.append(c)
            engines = after
        if not picked:
            return []
        # Worth it? Time to train the waiting backlog with the replicas there now, against
        # the time with the released cells joining after their switch, plus their way back.
        # More cells only shorten the second figure, so it is all the cells that fit or none.
        backlog = state.train_backlog_tokens
        rate = trainers_rate(state, p.default_train_tokens_per_s)
        added = sum(train_rate(c, p.default_train_tokens_per_s) for c in picked)
        left = backlog - rate * state.rollout_to_train_s
        if left <= 0:
            return []
        alone_s = backlog / rate if rate > 0 else math.inf
        joined_s = state.rollout_to_train_s + left / (rate + added)
        if joined_s + p.return_cost_weight * state.train_to_rollout_s >= alone_s:
            return []
        why = (f"demand {demand} fits {engines} engines; backlog {backlog} tokens trains in "
               f"{joined_s:.0f}s instead of {alone_s:.0f}s")
        return [RoleChange(c.cell, Role.TRAIN, why) for c in picked]

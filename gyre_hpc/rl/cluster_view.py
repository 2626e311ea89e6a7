"""The policy's view of the running fleet: a ``ClusterState`` built from live counters, and
the ``engines`` rows the loader and the simulator's ``measure`` read.

Everything here is measured on this fleet (engine decode rates over a window, replicas'
micro-batch speeds, flip costs), never assumed: cells that have not measured yet plan with
what their peers measured, and before the first flip the switch costs come from this fleet's
own weight broadcast.
"""
from __future__ import annotations

import math
import statistics
import time

from gyre_hpc.cells.controller import Controller
from gyre_hpc.rl.engine_pool import EnginePool
from gyre_hpc.rl.policy_inputs import DemandClock, run_of_request
from gyre_hpc.rl.router_client import RoutedCalls
from gyre_hpc.rl.step_state import StepState
from gyre_hpc.rl.train_queue import TrainQueue
from gyre_hpc.rundir.metrics import EngineRow
from gyre_hpc.sched.staleness import next_batch_waits, staleness_bound
from gyre_hpc.sched.state import CellState, ClusterState, Role
from gyre_hpc.sched.tail import DEFAULT_FRACTION as TAIL_FRACTION, RunProgress, tail_runs

# A flip to TRAIN moves the trainer's state: the weights and AdamW's two moments, 3x the bytes
# of the weights the engines receive after each step. Until this fleet has flipped a cell,
# the switch costs are planned from its own measured weight broadcast at this ratio.
STATE_BYTES_PER_WEIGHT_BYTE = 3


class ClusterView:
    def __init__(self, fleet: Controller, pool: EnginePool, calls: RoutedCalls, queue: TrainQueue, max_batch: int):
        self.fleet, self.pool, self.calls, self.queue = fleet, pool, calls, queue
        self.max_batch = max_batch
        # Measured flip costs by kind: a join in place (the cell held the core's state), a join
        # that moved the state to the cell, a flip to ROLLOUT. None: not measured yet.
        self.switch_s: dict[str, float | None] = {"in_place": None, "moved": None, "rollout": None}
        self._engine_mark = (time.monotonic(), dict(pool.transport.tokens))
        self._engine_rate: dict[int, float] = {}
        self._inflight_integral: dict[int, float] = {}   # engine -> sum of requests held x seconds
        self._last_tick = time.monotonic()
        self.demand = DemandClock(self.engine_capacity_requests())

    @property
    def plans_from_rates(self) -> bool:
        """A policy that weighs switches against training rates (elastic)."""
        return hasattr(getattr(self.fleet.policy, "params", None), "default_train_tokens_per_s")

    def engine_capacity_requests(self) -> int:
        """Requests one engine holds at the target occupancy: the policy's own target when it
        has one (elastic), else the engine's continuous-batching width."""
        params = getattr(self.fleet.policy, "params", None)
        return int(getattr(params, "target_requests_per_engine", 0) or self.max_batch)

    def tick(self) -> None:
        """Integrate each engine's requests in flight since the last tick (called every pump)."""
        now = time.monotonic()
        dt, self._last_tick = now - self._last_tick, now
        router = self.pool.router
        for e in router.engines:
            self._inflight_integral[e] = self._inflight_integral.get(e, 0.0) + dt * len(router.inflight(e))

    def state(self, st: StepState, ahead: StepState | None = None,
              has_weights: frozenset[int] = frozenset(), current: frozenset[int] | None = None) -> ClusterState:
        """The view while step ``st`` is the one training, with ``ahead`` the next step's runs
        rolling out ahead of it (async). Open runs are both steps' (the engines serve both),
        as the simulator counts them; the training work expected is ``st``'s. ``has_weights``:
        the cells that hold the current weights (they join in place; ``Flips.has_weights``);
        ``current``: those that hold the moments too (``Flips.current``; None: every cell)."""
        self._sample_cells(st)
        router, speeds, cells = self.pool.router, self.queue.speeds, self.fleet.cells
        inflight = router.inflight()
        queued = len(self.calls.queue)
        # Runs not started yet (their tasks have not run) count as open, youngest of all.
        steps = [st] if ahead is None else [st, ahead]
        tail = tail_runs({s.run_id: RunProgress(x.run_started.get(s.run_id, math.inf),
                                                x.run_calls[s.run_id].calls if s.run_id in x.run_calls else 0)
                          for x in steps for s in x.specs if s.run_id not in x.outcomes}, TAIL_FRACTION)
        waits = next_batch_waits(all(x.all_started for x in steps), steps[-1].step, self.fleet.policy_version,
                                 staleness_bound(self.fleet.policy), self.fleet.cfg.train.steps)
        serving = [c for c in cells if c.role is Role.ROLLOUT and c.id in router.engines]
        # Cells that never trained (or never served) plan with what the others measured:
        # the cells are alike, so the first micro-batch (engine window) is the prior.
        measured_train = [r for r in speeds.rates.values() if r > 0]
        measured_engine = [r for r in self._engine_rate.values() if r > 0]
        train_prior = statistics.median(measured_train) if measured_train else 0.0
        engine_prior = statistics.median(measured_engine) if measured_engine else 0.0

        def tail_on(cid: int) -> int:
            return sum(1 for rid in router.inflight(cid) if run_of_request(rid) in tail)

        cell_states = tuple(CellState(
            cell=c.id, kind=c.kind, role=c.role,
            inflight_requests=len(router.inflight(c.id)) if c.role is Role.ROLLOUT else 0,
            inflight_tokens=router.outstanding_tokens(c.id) if c.role is Role.ROLLOUT else 0,
            rollout_tokens_per_s=self._engine_rate.get(c.id, 0.0) or engine_prior,
            train_tokens_per_s=sum(speeds.rates.get(r, 0.0) for r in c.ranks) or train_prior * len(c.ranks),
            tail_requests=tail_on(c.id) if c.role is Role.ROLLOUT else 0,
            holds_moments=current is None or c.id in current) for c in cells)
        return ClusterState(time=time.time(), step=st.step, cells=cell_states,
                            unfinished_runs=sum(x.unfinished for x in steps), next_batch_waits=waits,
                            queued_requests=queued, inflight_requests=len(inflight),
                            tokens_inflight=sum(router.outstanding_tokens(e) for e in router.engines),
                            train_backlog_tokens=st.backlog_tokens(),
                            expected_train_tokens=self.queue.expected_tokens(st.unfinished),
                            policy_version=self.fleet.policy_version,
                            oldest_rollout_version=self.fleet.policy_version,
                            demand_over_capacity_s=self.demand.update(time.monotonic(), queued, len(inflight),
                                                                      len(serving)),
                            tail_runs=len(tail),
                            **self.switch_costs(all(c.id in has_weights for c in cells if c.role is Role.ROLLOUT)))

    def switch_costs(self, in_place: bool) -> dict[str, float]:
        """The flip costs the policy plans with: this fleet's own last flip of the kind a
        release would be now (``in_place``: every engine holds the current weights, as the
        simulator's ``Fleet.join_s`` decides it), and back; before one, its measured weight
        broadcast (x ``STATE_BYTES_PER_WEIGHT_BYTE`` to TRAIN, where the optimizer state moves
        too); before that, nothing (the state's defaults). A join in place never measured
        plans as one that moves the state: the dearer figure, until the fleet has made one."""
        out = {}
        push = self.pool.push_s
        join = self.switch_s["in_place"] if in_place and self.switch_s["in_place"] is not None else self.switch_s["moved"]
        for measured, key, prior in ((join, "rollout_to_train_s", STATE_BYTES_PER_WEIGHT_BYTE),
                                     (self.switch_s["rollout"], "train_to_rollout_s", 1)):
            if measured is not None:
                out[key] = measured
            elif push is not None:
                out[key] = prior * push
        return out

    def _sample_cells(self, st: StepState) -> None:
        """About once a second, one ``engines`` row per cell: an engine's decode tokens/s and
        requests in flight; a replica's measured training tokens/s while it had work (0 when
        it had none) and micro-batches in hand. The loader and the simulator's ``measure``
        read busy fractions and speeds from these rows."""
        now = time.monotonic()
        t0, marks = self._engine_mark
        if now - t0 < 1.0:
            return
        tokens = self.pool.transport.tokens
        self._engine_rate = {e: (tokens[e] - marks.get(e, 0)) / (now - t0) for e in marks}
        self._engine_mark = (now, dict(tokens))
        rows = []
        for c in self.fleet.cells:
            if c.role is Role.ROLLOUT:
                # Requests held on average over the same window as the rate, so the pair
                # (batch, tokens/s) describes one regime (an instantaneous count would not).
                held = self._inflight_integral.get(c.id, 0.0) / (now - t0)
                rows.append(EngineRow(time=time.time(), cell=c.id, tokens_per_s=self._engine_rate.get(c.id, 0.0),
                                      inflight=int(round(held)),
                                      tokens_inflight=self.pool.router.outstanding_tokens(c.id)))
            else:
                worked = any(self.queue.trained_in_window.get(r, 0) for r in c.ranks) or \
                    any(st.outstanding.get(r) for r in c.ranks)
                rate = sum(self.queue.speeds.rate(r) for r in c.ranks) if worked else 0.0
                rows.append(EngineRow(time=time.time(), cell=c.id, tokens_per_s=rate,
                                      inflight=sum(len(st.outstanding.get(r, [])) for r in c.ranks)))
        self.queue.trained_in_window.clear()
        self._inflight_integral = {}
        self.fleet.metrics.append(rows)

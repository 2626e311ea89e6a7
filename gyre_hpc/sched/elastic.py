"""The elastic policy: engines that the rollout tail no longer needs train instead.

Long-horizon agent runs have heavy-tailed durations, so late in a rollout batch a few
runs keep the batch open while most engines sit nearly idle. Finished runs (their whole
advantage group, in fact) are already trainable, so engines are released to the running
training step *while runs are still in flight* as soon as the unfinished work fits fewer
engines at the target occupancy; their in-flight requests migrate (with their KV cache)
to the engines that stay. Replicas come back only when queued work has exceeded serving
capacity for a sustained interval (``reclaim_after_s``), so a call queued for the instant
before dispatch never pulls a cell back, and a cell released in one decision is not
reclaimed by the next unless demand has been sustained. Capacity here is what the engines
hold at the target occupancy (``target_requests_per_engine`` each), which is what the
caller compares its demand against when it measures ``demand_over_capacity_s``.

The runs that decide the step (the tail: the ones expected to finish last) are protected:
an engine holding tail requests is never released, the tail must still find a lightly
loaded engine among those that remain, and, where the engines' decode step is known
(``step_*``, sized from the device model), the engines that remain must decode the open
runs and the KV they hold within ``tail_slowdown`` of the step every non-core cell would
take (colocate's deployment): a step reads every resident sequence's KV, so long contexts
make a shared engine slower than its request count says.

Off-policy with a train floor (``holding_split``) the floor's static split is the plan, and
elastic adds what the split leaves idle. Such a split is sized for throughput, so its engines
run far above the on-policy occupancy by design and the on-policy sizing would never release
one. Its own rule: once every run that can start before the running step's update has started
(``ClusterState.next_batch_waits``), the open runs are all the engines will serve until then,
and they need only the engines that admit them all at once (``max_requests_per_engine`` each,
the device's admission limit, and their KV at ``fill``), the split's peak occupancy or less;
the others train the running step, if that pays, and return, all at once, when a batch may
start (or a call waits for an engine). The runs in a step's tail then decode on fewer engines,
more slowly; they are trained in the next step, which starts on the runs already done. A cell
that trained the last update holds the core's state and joins in place; the split's engines
never train, but each update's weights are sent to them, so they join in place too, weights
only (``rl.flips``). The rule is opt-in (``max_requests_per_engine``):
measured on paced cells it lost to the split it holds (docs/rl.md).

Where releasing would not pay, elastic holds what colocate holds: every cell serves a
batch that starts with nothing to train, and once a batch is over the engines left serving
train too when cells were released during it, so the next batch starts on every cell at
once (an engine left serving alone takes every first call, and a run stays where its
prefix is cached).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from gyre_hpc.sched.capacity import (
    arriving_engines, flippable, rollout_demand, serving_engines, train_rate, trainers_rate,
)
from gyre_hpc.sched.state import CellKind, CellState, ClusterState, Role, RoleChange


@dataclass(frozen=True)
class ElasticParams:
    # Requests one engine holds while each sequence still decodes near its single-sequence
    # speed (the target occupancy). Past it, batching makes every sequence slower, and the
    # tail runs are exactly the ones that would pay. Sized from the device model
    # (``device_sized``: the simulator and paced cells alike); a native fleet sets it from
    # the engine benchmark.
    target_requests_per_engine: int = 16
    # KV-cache tokens one engine holds, for cells that report none themselves
    # (``CellState.kv_capacity_tokens == 0``). 0: no KV check for such cells.
    kv_tokens_per_engine: int = 0
    # Release only while the remaining engines would be at most this full (of the target
    # and of their KV capacity): headroom for runs coming back from a tool call.
    fill: float = 0.8
    # Requests a tail run may share its engine with and still count as lightly loaded
    # (its own request included): the remaining engines must offer the tail this.
    # 0: half the target occupancy.
    tail_engine_requests: int = 0
    # Release only if it shortens the training of the waiting backlog by more than this
    # many switches back (train->rollout).
    return_cost_weight: float = 1.0
    # Hysteresis: reclaim replicas only once queued work has exceeded serving capacity
    # continuously for this long (``ClusterState.demand_over_capacity_s``).
    reclaim_after_s: float = 30.0
    # A PRIOR for a cell's training tokens/s until it has been measured
    # (``CellState.train_tokens_per_s == 0``). The caller sets it from a measurement
    # (``bench switch``, the first micro-batch, or the simulator's workload); the default
    # is the order of one 8-GPU node training a ~7B model on long sequences.
    default_train_tokens_per_s: float = 2000.0
    # Requests one engine admits at once (the device's ``max_seqs``): how a split held
    # off-policy sizes the engines its open runs need once no run can start before the
    # update (see the module docstring). 0 (the default, and ``device_sized`` leaves it): such
    # a split releases nothing while a run is open. Opt-in because on paper-local's paced fleet
    # it has not beaten the split it holds (a taken-back floor cell's return flip costs the next
    # step its start; runs rolled out ahead finish later on the engine left, and the next step
    # waits for them); at best it ties, since the joiner's few seconds
    # are worth less than the run-sized quantum the step ends on (the measurements: docs/rl.md,
    # "The rule measured" and "Why elastic at staleness 1 ties the split").
    # At most the device's max_seqs (``device_sized`` refuses more).
    max_requests_per_engine: int = 0
    # Versions a rollout may lag the trainer; elastic is on-policy by default.
    max_staleness: int = 0
    # Cells that train whatever the rollout wants (core included): a static split elastic
    # holds as its floor and releases beyond. With staleness >= 1 the next batch rolls out
    # while this one trains, so the step is throughput-bound and the best split is found
    # by throughput (``gyre-hpc sim`` finds it: ``async_tuned``); elastic then adds what its
    # releases win on top (never slower than the split across the simulator's sensitivity
    # sweep; measured, not guaranteed). 0: no floor.
    train_floor_cells: int = 0
    # The engines' decode step, per token of each sequence: ``step_fixed_s + n x
    # step_per_seq_s + K x step_per_kv_token_s`` for n sequences holding K KV tokens (the
    # weights read once a step, amortised; every resident sequence's KV read every step).
    # Sized from the device model (``device_sized``); a native fleet sets it from the engine
    # benchmark. All 0: unknown, and a release is sized by requests and KV capacity alone.
    step_fixed_s: float = 0.0
    step_per_seq_s: float = 0.0
    step_per_kv_token_s: float = 0.0
    # The most a release may lengthen the decode step of the engines that remain, against
    # the step they would take with every non-core cell serving (colocate's deployment, at
    # the same demand and KV): the tail's protection by what a step reads, not by requests.
    # 0: never release while a run is open (elastic is then colocate). ``device_sized``
    # takes the engine's own tolerated slowdown (the one that sizes the target occupancy).
    tail_slowdown: float = 0.1

    def __post_init__(self) -> None:
        if self.kv_tokens_per_engine < 0:
            raise ValueError(f"elastic kv_tokens_per_engine={self.kv_tokens_per_engine}: must be >= 0 (0 = unchecked)")
        if self.target_requests_per_engine < 1:
            raise ValueError(f"elastic target_requests_per_engine={self.target_requests_per_engine}: must be >= 1")
        if not 0 < self.fill <= 1:
            raise ValueError(f"elastic fill={self.fill}: must be in (0, 1]")
        if self.tail_engine_requests < 0:
            raise ValueError(f"elastic tail_engine_requests={self.tail_engine_requests}: must be >= 0 (0 = half the target)")
        if self.return_cost_weight < 0:
            raise ValueError(f"elastic return_cost_weight={self.return_cost_weight}: must be >= 0")
        if self.reclaim_after_s < 0:
            raise ValueError(f"elastic reclaim_after_s={self.reclaim_after_s}: must be >= 0")
        if self.default_train_tokens_per_s <= 0:
            raise ValueError(f"elastic default_train_tokens_per_s={self.default_train_tokens_per_s}: must be > 0")
        if self.max_requests_per_engine < 0:
            raise ValueError(f"elastic max_requests_per_engine={self.max_requests_per_engine}: must be >= 0 "
                             f"(0 = unknown)")
        if self.max_staleness < 0:
            raise ValueError(f"elastic max_staleness={self.max_staleness}: must be >= 0")
        if self.train_floor_cells < 0:
            raise ValueError(f"elastic train_floor_cells={self.train_floor_cells}: must be >= 0 (0 = no floor)")
        for name in ("step_fixed_s", "step_per_seq_s", "step_per_kv_token_s", "tail_slowdown"):
            if getattr(self, name) < 0:
                raise ValueError(f"elastic {name}={getattr(self, name)}: must be >= 0")

    @property
    def step_modelled(self) -> bool:
        return self.step_fixed_s > 0 or self.step_per_seq_s > 0 or self.step_per_kv_token_s > 0

    def step_s(self, engines: int, requests: int, kv_tokens: float) -> float:
        """The decode step (seconds a token) of ``requests`` holding ``kv_tokens`` spread
        evenly over ``engines`` (the router balances them)."""
        n = max(engines, 1)
        return self.step_fixed_s + (requests * self.step_per_seq_s + kv_tokens * self.step_per_kv_token_s) / n


def device_sized(engine, train, given: Mapping[str, Any] | None = None) -> ElasticParams:
    """Elastic's parameters sized from a device model (``gyre_hpc.devices``: ``engine`` an
    ``EngineModel``, ``train`` a ``TrainModel``), with the explicitly ``given`` fields over them.

    The simulator and a fleet of paced cells both call this, so the policy the simulator
    forecasts is the one the fleet runs: the target occupancy is the batch at which a sequence
    decodes within the engine's tolerated slowdown of its speed alone, the KV figure the
    engine's capacity, the training-rate prior one replica's modelled rate.
    """
    h, single = engine.half_saturation_seqs, engine.single_seq_tokens_per_s
    sizing = {"target_requests_per_engine": engine.target_seqs(), "kv_tokens_per_engine": engine.kv_capacity_tokens(),
              "default_train_tokens_per_s": train.tokens_per_s,
              # EngineModel.step_s(n, K) = (h + n) / ((1 + h) single) + K kv_read_s_per_token
              "step_fixed_s": h / ((1.0 + h) * single), "step_per_seq_s": 1.0 / ((1.0 + h) * single),
              "step_per_kv_token_s": engine.kv_read_s_per_token, "tail_slowdown": engine.tolerated_slowdown}
    params = ElasticParams(**{**sizing, **dict(given or {})})
    if params.max_requests_per_engine > engine.max_seqs:
        # An engine admits max_seqs at once: sized above it, a held split releases an engine
        # whose runs then queue on the one left, takes it back for the queue, and releases it
        # again (the simulator flipped a cell ~9,000 times in 8 steps at 48 on 32 slots).
        raise ValueError(f"elastic max_requests_per_engine={params.max_requests_per_engine} is more than the "
                         f"engine admits at once (max_seqs={engine.max_seqs})")
    return params


def kv_capacity(cell: CellState, fallback: int) -> int:
    """KV tokens a cell's engine holds: its own report, else the configured figure (0 = unknown)."""
    return cell.kv_capacity_tokens if cell.kv_capacity_tokens > 0 else fallback


@dataclass(frozen=True)
class ElasticPolicy:
    params: ElasticParams = ElasticParams()

    @property
    def max_staleness(self) -> int:
        return self.params.max_staleness

    def engines_needed(self, state: ClusterState, demand: int, kv_per_engine: int) -> int:
        """Engines that hold ``demand`` requests at the target occupancy and the KV tokens in
        flight at ``fill`` of ``kv_per_engine`` (0: KV not known)."""
        p = self.params
        n = math.ceil(demand / p.target_requests_per_engine)
        if kv_per_engine:
            n = max(n, math.ceil(state.tokens_inflight / (p.fill * kv_per_engine)))
        return n

    @property
    def light(self) -> int:
        """Requests a tail run may share an engine with and still count as lightly loaded."""
        p = self.params
        return p.tail_engine_requests or max(1, p.target_requests_per_engine // 2)

    def holds_tail(self, n: int, demand: int, tail: int, fill: float) -> bool:
        """Whether ``n`` engines hold ``demand`` requests at ``fill`` of the target with each
        of the ``tail`` runs on a lightly loaded engine: the tail takes ceil(tail / light)
        engines, the rest of the demand must fit the others."""
        per = fill * self.params.target_requests_per_engine
        if demand > per * n:
            return False
        if tail <= 0:
            return True
        tail_engines = math.ceil(tail / self.light)
        rest = demand - min(tail, demand)
        spare = tail_engines * self.light - tail
        return tail_engines <= n and rest - spare <= per * (n - tail_engines)

    def __call__(self, state: ClusterState) -> list[RoleChange]:
        changes = self._to_floor(state) or self._reclaim(state)
        if changes:
            return changes
        return self._release(state)

    @property
    def holding_split(self) -> bool:
        """Off-policy with a floor: the step is throughput-bound and the floor's split is
        the plan; cells beyond it train only while no new run can start (the open runs fit
        the engines that stay) and all return at once when a batch may start."""
        return bool(self.params.train_floor_cells) and self.params.max_staleness >= 1

    def _to_floor(self, state: ClusterState) -> list[RoleChange]:
        """Cells to TRAIN until the floor's split holds (cells already switching count)."""
        floor = self.params.train_floor_cells
        trainers = len(state.in_role(Role.TRAIN))
        if trainers >= floor:
            return []
        engines = sorted(flippable(state, Role.ROLLOUT), key=release_order)
        picked = engines[:max(0, min(floor - trainers, len(serving_engines(state)) - 1))]
        why = f"train floor: {floor} cells train (a static split held), {trainers} do"
        return [RoleChange(c.cell, Role.TRAIN, why) for c in picked]

    def _above_floor(self, state: ClusterState, candidates: list[CellState]) -> list[CellState]:
        """The reclaimable replicas: never so many that the floor's split breaks."""
        spare = len(state.in_role(Role.TRAIN)) - self.params.train_floor_cells
        return candidates[:max(0, spare)] if self.params.train_floor_cells else candidates

    def _reclaim(self, state: ClusterState) -> list[RoleChange]:
        p = self.params
        candidates = flippable(state, Role.TRAIN)
        demand = rollout_demand(state)
        if not candidates or demand == 0:
            return []
        arriving = arriving_engines(state)
        engines = len(arriving)
        # Those without the moments first (kept in TRAIN, each would take the core's weights
        # at every update), then highest id: the order is fixed so that replays of a run
        # decide the same way.
        candidates = self._above_floor(state, sorted(candidates, key=lambda c: (c.holds_moments, -c.cell)))
        if not candidates:
            return []
        if self.holding_split:
            if state.next_batch_waits and state.queued_requests == 0:
                return []   # no run can start before the update, and every call found an engine
            # A batch may start (or calls wait for an engine): the split's engines come
            # back, all of them, at once (a batch on fewer engines than the split is slower).
            why = (f"{demand} requests and runs waiting"
                   + ("" if state.next_batch_waits else ", a batch may start")
                   + f": the {len(candidates)} cells released beyond the "
                   f"train floor of {p.train_floor_cells} return to the split")
            return [RoleChange(c.cell, Role.ROLLOUT, why) for c in candidates]
        kv = kv_capacity(candidates[0], p.kv_tokens_per_engine)
        need = self.engines_needed(state, demand, kv) - engines
        # Unfinished runs are not a blip: each calls the model again, and within a batch
        # their number only falls. More of them than the engines hold at the full target
        # (the tail on lightly loaded engines) is a new batch starting on fewer engines than
        # it needs: reclaim at once. A release needed them to fit at ``fill`` of the target
        # on the engines that stayed, so this never undoes one within the batch.
        runs = state.unfinished_runs
        more = 0
        while more < len(candidates) and not self.holds_tail(engines + more, runs, state.tail_runs, 1.0):
            more += 1
        if engines == 0:
            # No engine at all, none coming: not a question of capacity, the runs cannot
            # proceed. This is the start of a batch after everything trained: with nothing
            # left to train, a cell kept in TRAIN idles until the batch's first group ends
            # while the batch decodes on fewer engines (slower, the more so the longer its
            # contexts, whose KV every step reads), so every cell serves it.
            picked = candidates if not state.train_backlog_tokens else candidates[:max(need, more, 1)]
            why = (f"{demand} requests and runs waiting, no engine serving or arriving: "
                   f"{len(picked)} of {len(candidates)} replicas become engines "
                   f"({p.target_requests_per_engine} requests each"
                   + (f", the tail of {state.tail_runs} runs at <= {self.light} each" if state.tail_runs else "")
                   + ")")
            return [RoleChange(c.cell, Role.ROLLOUT, why) for c in picked]
        if more:
            picked = candidates[:more]
            why = (f"{runs} unfinished runs (each calls the model again) exceed {engines} engines x "
                   f"{p.target_requests_per_engine}"
                   + (f" with the tail of {state.tail_runs} runs at <= {self.light} each" if state.tail_runs else "")
                   + f": {len(picked)} more engines")
            return [RoleChange(c.cell, Role.ROLLOUT, why) for c in picked]
        # Requests beyond the runs (sub-agents calling in parallel) or KV: only when sustained.
        if need <= 0 or state.demand_over_capacity_s < p.reclaim_after_s:
            return []
        picked = candidates[:need]
        why = (f"demand above capacity for {state.demand_over_capacity_s:.0f}s >= {p.reclaim_after_s:.0f}s: "
               + (f"demand {demand} > {engines} engines x {p.target_requests_per_engine}"
                  if demand > engines * p.target_requests_per_engine else
                  f"{state.tokens_inflight} KV tokens > {engines} engines x {p.fill:g} x {kv}")
               + f", {len(picked)} more engines")
        return [RoleChange(c.cell, Role.ROLLOUT, why) for c in picked]

    def _fits(self, state: ClusterState, remaining: list[CellState], demand: int) -> bool:
        """Whether ``demand`` fits ``remaining`` engines at ``fill`` of their target and of
        their KV capacity, with the tail's requests each on a lightly loaded engine."""
        p = self.params
        caps = [kv_capacity(c, p.kv_tokens_per_engine) for c in remaining]
        if remaining and all(caps) and state.tokens_inflight > p.fill * sum(caps):
            return False
        if not self.step_holds(state, len(remaining), demand):
            return False
        return self.holds_tail(len(remaining), demand, state.tail_runs, p.fill)

    def step_holds(self, state: ClusterState, engines: int, demand: int) -> bool:
        """Whether ``engines`` decode ``demand`` requests and the KV of every started run
        (``tokens_inflight``: runs in a tool call come back to theirs) within ``tail_slowdown``
        of the step every non-core cell serving them would take (what colocate holds)."""
        p = self.params
        if not p.step_modelled:
            return True
        full = sum(1 for c in state.cells if c.kind is not CellKind.CORE)
        return (p.step_s(engines, demand, state.tokens_inflight)
                <= (1.0 + p.tail_slowdown) * p.step_s(full, demand, state.tokens_inflight) * (1 + 1e-9))

    def _release(self, state: ClusterState) -> list[RoleChange]:
        p = self.params
        if state.queued_requests > 0:
            return []
        if self.holding_split and not state.next_batch_waits:
            # Holding a throughput-sized split off-policy: while a batch may still start, every
            # engine of the split is needed (the next batch starts on them as soon as the bound
            # lets it), and a cell released now would be called back before it trained. Once no
            # run can start before the update, the open runs are sized below.
            return []
        demand = rollout_demand(state)
        serving = serving_engines(state)
        if (state.unfinished_runs == 0 and state.train_backlog_tokens > 0 and not self.holding_split
                and self._above_floor(state, flippable(state, Role.TRAIN))):
            # The batch is over and cells released during it train: the engines left serve no
            # run and would take every first call of the next batch before the others are
            # back (a run stays where its prefix is cached). As colocate does, they train too,
            # and the next batch starts on every cell at once.
            why = (f"every run of the batch is done, {state.train_backlog_tokens} tok to train: the last "
                   f"{len(serving)} engines train too (the next batch starts on every cell at once)")
            return [RoleChange(c.cell, Role.TRAIN, why) for c in flippable(state, Role.ROLLOUT)]
        if self.holding_split:
            picked, remaining = self._admitting(state, serving)
        else:
            picked, remaining = self._occupancy_sized(state, serving, demand)
        if not picked:
            return []
        # Worth it? The training work of this batch: the backlog waiting now plus what the
        # unfinished runs are expected to add (measured per finished run), with the replicas
        # there now, against the same with the released cells joining after their switch,
        # plus their way back. More cells only shorten the second figure: all that fit or none.
        backlog = state.train_backlog_tokens
        work = backlog + state.expected_train_tokens
        rate = trainers_rate(state, p.default_train_tokens_per_s)
        added = sum(train_rate(c, p.default_train_tokens_per_s) for c in picked)
        left = work - rate * state.rollout_to_train_s
        if left <= 0:
            return []
        alone_s = work / rate if rate > 0 else math.inf
        joined_s = state.rollout_to_train_s + left / (rate + added)
        back_s = state.train_to_rollout_s
        if self.holding_split:
            # The way back delays the next batch on the split's engines: a batch started on
            # fewer engines keeps its runs where they landed, so count a whole flip cycle.
            back_s += state.rollout_to_train_s
        if joined_s + p.return_cost_weight * back_s >= alone_s:
            return []
        n = len(remaining)
        if state.unfinished_runs == 0:
            fits = "every run of the batch is done"
        elif self.holding_split:
            fits = (f"no run starts before the update: {state.unfinished_runs} open runs fit {n} engines "
                    f"(<= {p.max_requests_per_engine} each)")
        else:
            fits = (f"demand {demand} fits {n} engines (<= {p.fill:g} x {p.target_requests_per_engine}"
                    + (f", tail {state.tail_runs} at <= {self.light} each" if state.tail_runs else "") + ")")
        what = (f"backlog {backlog} tok" if not state.expected_train_tokens else
                f"{work} tok (backlog {backlog} + {state.expected_train_tokens} from {state.unfinished_runs} runs)")
        why = (f"{fits}; {what} trains in {_secs(joined_s)} not {_secs(alone_s)} "
               f"(switch {state.rollout_to_train_s:.2f}+{state.train_to_rollout_s:.2f}s)")
        return [RoleChange(c.cell, Role.TRAIN, why) for c in picked]

    def _occupancy_sized(self, state: ClusterState, serving: list[CellState],
                         demand: int) -> tuple[list[CellState], list[CellState]]:
        """On-policy: engines to release while the demand fits those that stay at the target
        occupancy (``_fits``); returns (released, staying)."""
        # Never a cell whose engine holds tail requests: migrating them slows the slowest run.
        candidates = sorted((c for c in flippable(state, Role.ROLLOUT) if c.tail_requests == 0), key=release_order)
        remaining = list(serving)
        picked: list[CellState] = []
        for c in candidates:
            after = [x for x in remaining if x.cell != c.cell]
            if state.unfinished_runs > 0 and not after:
                break  # the last engine stays while any run can still call the model
            if state.unfinished_runs > 0 and not self._fits(state, after, demand):
                break
            picked.append(c)
            remaining = after
        return picked, remaining

    def _admitting(self, state: ClusterState, serving: list[CellState]) -> tuple[list[CellState], list[CellState]]:
        """A split held off-policy, no run to start before the update (``_release`` asks only
        then): the engines that admit every open run at once (``max_requests_per_engine`` each,
        their KV at ``fill``) stay, the others may go; returns (released, staying)."""
        p = self.params
        runs = state.unfinished_runs
        if runs and not p.max_requests_per_engine:
            return [], list(serving)
        keep = math.ceil(runs / p.max_requests_per_engine) if runs else 0
        caps = [kv_capacity(c, p.kv_tokens_per_engine) for c in serving]
        if caps and all(caps):
            keep = max(keep, math.ceil(state.tokens_inflight / (p.fill * min(caps))))
        candidates = sorted(flippable(state, Role.ROLLOUT), key=release_order)
        picked = candidates[:max(0, len(serving) - keep)]
        return picked, [c for c in serving if c not in picked]


def release_order(c: CellState) -> tuple[bool, int, int]:
    """Which engine a release takes first: one that holds the core's moments (it applies the
    update itself; one without takes the core's weights at the update, a broadcast the step's
    end waits on), then the fewest in-flight requests (least KV to migrate), then highest id
    (fixed, so replays of a run decide the same way)."""
    return not c.holds_moments, c.inflight_requests, -c.cell


def _secs(x: float) -> str:
    """Seconds in a reason: short enough that a reason fits the timeline's 160-byte detail."""
    return "never" if math.isinf(x) else f"{x:.2f}s" if x < 10 else f"{x:.1f}s" if x < 100 else f"{x:.0f}s"

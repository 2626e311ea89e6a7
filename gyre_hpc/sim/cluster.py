"""The discrete-event simulation of a fleet of cells running RL steps under one policy.

Events sit in one heapq, ordered by (time, sequence number), so a seed fixes the run.
The engines are processor-sharing queues: every sequence on an engine decodes at the same
batch-dependent speed, so an engine tracks one "service clock" (tokens each of its
sequences has received) and a heap of the clock readings at which each finishes. A change
in batch size only moves the engine's next-completion event; nothing is recomputed per
sequence. The trainer is a fluid: trainable tokens drain at the replicas' summed rate.

Each decision epoch builds a ``ClusterState`` from these counters and calls the very
policy the runtime calls; the changes it returns are applied with their switch costs.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time as wallclock
from collections import deque
from typing import Mapping

from gyre_hpc.rundir.metrics import EngineRow, EventRow, RunRow, StepRow, TimelineRow
from gyre_hpc.sched.observed_floor import FloorRange, StepObservation, observed_floor
from gyre_hpc.sched.staleness import may_launch_batch, next_batch_waits, staleness_bound
from gyre_hpc.sched.state import CellKind, CellState, ClusterState, Policy, Role, RoleChange
from gyre_hpc.sched.tail import RunProgress, tail_runs
from gyre_hpc.sim.batch import Batch, sample_batch
from gyre_hpc.sim.result import SimResult
from gyre_hpc.sim.workload import Workload

# event kinds
_ENGINE, _TOOL, _SWITCH, _DRAIN, _OPT, _DECIDE, _LAUNCH, _SAMPLE, _DEADLINE, _PREFILLED, _ROUTE = range(11)
_QUEUED, _AWAY = -2, -1   # where a run is when not on an engine: waiting for one, or in a tool call
# busy-accounting categories of a cell
ROLLOUT_BUSY, ROLLOUT_IDLE, TRAIN_BUSY, TRAIN_IDLE, SWITCH = range(5)
_EPS = 1e-6


class SimError(RuntimeError):
    """The policy asked for something a fleet cannot do (flip the core cell, ...)."""


class _Engine:
    __slots__ = ("clock", "t", "heap", "stamp", "load_stamp", "ctx", "parked", "parked_ctx", "seq_s", "kv_s",
                 "pf", "pf_ctx", "pf_until", "pf_from")

    def __init__(self) -> None:
        self.clock = 0.0      # tokens each resident sequence has been served
        self.t = 0.0
        self.heap: list[tuple[float, int]] = []   # (clock at which it finishes, run)
        self.stamp = 0        # invalidates this engine's pending completion event
        self.load_stamp = 0   # invalidates its entries in the least-loaded heap
        self.ctx = 0.0        # KV tokens held by the sequences decoding
        # KV kept for runs away in a tool call (prefix cache), oldest first; evicted when an
        # admission needs the room. Only tracked when the engine's KV capacity is modelled.
        self.parked: dict[int, float] = {}
        self.parked_ctx = 0.0
        self.seq_s = 0.0      # integral of resident sequences over time (slot occupancy)
        self.kv_s = 0.0       # integral of KV tokens held over time
        # Calls prefilling: one at a time at the engine's compute rate (FIFO), each holding
        # its slot and KV; run -> (placement number, decode work to follow).
        self.pf: dict[int, tuple[int, float]] = {}
        self.pf_ctx = 0.0
        self.pf_until = 0.0   # when the prefill server is free
        self.pf_from = 0.0    # since when it has been busy without a break (decode waits then, in-step prefill)

    @property
    def resident(self) -> int:
        return len(self.heap) + len(self.pf)


class _Cell:
    __slots__ = ("id", "kind", "role", "switching", "cat", "since", "acc")

    def __init__(self, cid: int, kind: CellKind, role: Role) -> None:
        self.id, self.kind, self.role, self.switching = cid, kind, role, False
        self.cat, self.since, self.acc = -1, 0.0, [0.0] * 5


class FleetSim:
    def __init__(self, w: Workload, policy: Policy, policy_name: str, batches: Mapping[int, Batch] | None = None):
        self.w, self.policy, self.name = w, policy, policy_name
        # Given batches (a real run's own runs, ``sim.trace``) replace sampled ones step by step.
        self.given = dict(batches or {})
        self.staleness = staleness_bound(policy)
        f, e = w.fleet, w.engine
        n_ro, core = f.rollout_only, w.core_cells
        self.cells = [_Cell(i, CellKind.CORE, Role.TRAIN) for i in range(core)] + [
            _Cell(i, CellKind.ROLLOUT_ONLY if i > f.cells - 1 - n_ro else CellKind.ELASTIC, Role.ROLLOUT)
            for i in range(core, f.cells)]
        self.engines = [_Engine() for _ in self.cells]
        self.dev = e
        self.kv_cap = e.kv_capacity_tokens()
        self.run_placed: list[int] = []     # placements of each run: invalidates stale prefill events
        self.max_active = w.run.max_concurrent_runs or w.run.runs_per_step
        self.events: list[tuple] = []
        self.seq = 0
        self.now = 0.0
        self.n_events = 0
        self.load_heap: list[tuple[int, int, int]] = []
        self.queue: deque[tuple[int, float, bool]] = deque()   # (run, work, KV travels with it)
        # runs (flat, across batches)
        self.run_batch: list[int] = []
        self.run_idx: list[int] = []
        self.run_deadline: list[float] = []
        self.run_tokens: list[float] = []
        self.run_start: list[float] = []
        self.run_migrations: list[int] = []
        self.run_where: list[int] = []      # engine cell decoding it, or _QUEUED / _AWAY
        self.run_done: list[bool] = []
        self.run_home: list[int] = []       # engine holding the run's cached prefix, or -1
        self.run_cached: list[float] = []   # context tokens a call must prefill again away from home
        self.pending: deque[int] = deque()  # runs launched, waiting for a place in the harness pool
        self.active: set[int] = set()       # runs started and unfinished
        # Since when demand has exceeded what the serving engines hold (calls still queued
        # after dispatch, for want of a slot or KV memory, or more requests and runs than
        # the target occupancy), as seen by the decision epochs; None while it does not.
        self.over_since: float | None = None
        # What an engine holds before demand counts as over capacity: the policy's own bulk
        # target when it has one (elastic), else the engine's slots (the runtime's DemandClock).
        self.target = int(getattr(getattr(policy, "params", None), "target_requests_per_engine", 0) or e.max_seqs)
        self.batches: dict[int, Batch] = {}
        self.run_base: dict[int, int] = {}
        self.batch_version: dict[int, int] = {}
        self.group_left: dict[tuple[int, int], int] = {}
        self.group_tokens: dict[tuple[int, int], float] = {}
        self.unfinished: dict[int, int] = {}
        # trainer
        self.version = 0
        self.tr_avail = 0.0
        self.tr_rate = 0.0
        self.tr_t = 0.0
        self.tr_stamp = 0
        self.tr_busy = False
        self.optimizing = False
        # Every join goes in place (``fleet.in_place_join_s``): the runtime sends each update's
        # weights to every engine at once, so an engine that lacks the optimizer moments joins
        # weights only (``rl.flips``).
        self.switch_dur: dict[int, tuple[float, bool]] = {}   # cell -> (its switch's cost, a join in place)
        self.backlog: dict[int, float] = {}
        self.trained: dict[int, float] = {}
        # batches
        self.next_batch = 0
        self.launch_pending = False
        self.engines_version = 0
        self.decide_pending = False
        self.route_pending = False
        self.cell_state_cache: dict[int, tuple] = {}
        self.last_step_end = 0.0
        self.done = False
        # outputs
        self.switches = 0
        self.runs_finished = 0
        self.runs_cut = 0
        self.finished_tokens = 0.0   # tokens of finished runs: the per-run measure a runtime has
        self.timeline: list[TimelineRow] = []
        self.steps: list[StepRow] = []
        self.engine_rows: list[EngineRow] = []
        self.event_rows: list[EventRow] = []
        self.run_rows: list[RunRow] = []
        self.step_s: list[float] = []
        # policy.floor "observed": elastic's floor set after each step from what it measured
        # (sched.observed_floor); the cell-time totals at the last step's end and the longest
        # run finished since.
        self.observe_floor = w.policy.floor == "observed" and hasattr(policy, "params") and hasattr(
            policy.params, "train_floor_cells")
        self.floor_history: list[StepObservation] = []
        self.floors: list[int] = []
        self.acc_at_step: list[float] = [0.0] * 5
        self.longest_run_s = 0.0
        if self.observe_floor:
            self.hold_floor(observed_floor([], self.floor_range()))

    # ---------------------------------------------------------------- plumbing
    def push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def category(self, c: _Cell) -> int:
        if c.switching:
            return SWITCH
        if c.role is Role.ROLLOUT:
            return ROLLOUT_BUSY if self.engines[c.id].resident else ROLLOUT_IDLE
        return TRAIN_BUSY if self.tr_busy else TRAIN_IDLE

    def touch(self, c: _Cell) -> None:
        cat = self.category(c)
        if cat != c.cat:
            if c.cat >= 0:
                c.acc[c.cat] += self.now - c.since
            c.cat, c.since = cat, self.now

    def serving(self, c: _Cell) -> bool:
        return c.role is Role.ROLLOUT and not c.switching

    # ---------------------------------------------------------------- engines
    def rate(self, e: _Engine) -> float:
        """Tokens/s of each decoding sequence: the batch's size and the KV it reads each step."""
        return self.dev.per_seq_tokens_per_s(len(e.heap), e.ctx)

    def decode_tokens_per_s(self, e: _Engine) -> float:
        """What the engine's decoding sequences produce together (prefilling ones move none)."""
        return len(e.heap) * self.rate(e) if e.heap else 0.0

    def decoding_s(self, e: _Engine, until: float) -> float:
        """Seconds of [e.t, until] the engine decodes: all of it, less the prefills when they
        run inside its steps (``EngineModel.prefill_in_step``: the decode waits for them)."""
        dt = until - e.t
        if self.dev.prefill_in_step:
            dt -= max(0.0, min(until, e.pf_until) - max(e.t, e.pf_from))
        return dt

    def advance(self, e: _Engine) -> None:
        dt = self.now - e.t
        if e.heap:
            e.clock += self.rate(e) * self.decoding_s(e, self.now)
        if e.heap or e.pf:
            e.seq_s += e.resident * dt
            e.kv_s += (e.ctx + e.pf_ctx + e.parked_ctx) * dt
        e.t = self.now

    def reschedule(self, cid: int) -> None:
        e = self.engines[cid]
        e.stamp += 1
        if e.heap:
            dt = max(e.heap[0][0] - e.clock, 0.0) / self.rate(e)
            if self.dev.prefill_in_step:
                dt += max(0.0, e.pf_until - max(self.now, e.pf_from))   # the decode waits for the prefills
            self.push(self.now + dt, _ENGINE, cid, e.stamp)
        e.load_stamp += 1
        if self.serving(self.cells[cid]):
            heapq.heappush(self.load_heap, (e.resident, cid, e.load_stamp))
        if len(self.load_heap) > 64 * len(self.cells):
            # Stale entries are only dropped when they reach the top; rebuild now and then
            # so the heap stays the size of the fleet rather than of the event count.
            self.load_heap = [(x.resident, i, x.load_stamp) for i, x in enumerate(self.engines)
                              if self.serving(self.cells[i])]
            heapq.heapify(self.load_heap)

    def route(self, run: int, work: float, front: bool = False, warm: bool = False, prefill: float = 0.0) -> None:
        """The run's home engine (the one holding its cached prefix) if it has a slot and
        room, else the least-loaded serving engine with a free slot and room for the call's
        KV cache (context tokens x bytes per token against the engine's memory), else the
        FIFO queue. Away from home the cached context is prefilled again, unless the KV
        travels with the call (``warm``: a migration). An engine with nothing decoding
        admits any call: a context larger than one engine's KV memory would otherwise
        never run."""
        max_seqs, cap = self.w.engine.max_seqs, self.kv_cap
        need = self.ctx_of(run)
        home = self.run_home[run] if cap else -1
        if home >= 0:
            e = self.engines[home]
            if (self.serving(self.cells[home]) and e.resident < max_seqs
                    and (not e.resident or e.ctx + e.pf_ctx + need <= cap)):
                self.place(run, home, work, prefill)
                return
        skipped = []
        placed = -1
        while self.load_heap:
            n, cid, stamp = self.load_heap[0]
            e = self.engines[cid]
            if stamp != e.load_stamp or not self.serving(self.cells[cid]):
                heapq.heappop(self.load_heap)
                continue
            if n >= max_seqs:
                break
            if cap and e.resident and e.ctx + e.pf_ctx + need > cap:
                skipped.append(heapq.heappop(self.load_heap))
                continue
            heapq.heappop(self.load_heap)
            placed = cid
            break
        for item in skipped:
            heapq.heappush(self.load_heap, item)
        if placed >= 0:
            if cap and not warm and self.run_cached[run]:
                # away from its cached prefix: the whole earlier context is prefilled again
                self.unpark(run)
                prefill += self.dev.prefill_s(self.run_cached[run])
            self.place(run, placed, work, prefill)
            return
        self.run_where[run] = _QUEUED
        if front:
            self.queue.appendleft((run, work, warm, prefill))
        else:
            self.queue.append((run, work, warm, prefill))

    def place(self, run: int, cid: int, work: float, prefill: float = 0.0) -> None:
        e = self.engines[cid]
        self.advance(e)
        self.run_where[run] = cid
        need = self.ctx_of(run)
        self.run_placed[run] += 1
        if prefill > 0:
            # The engine's prefill server: one prompt at a time at compute speed; the call
            # holds its slot and KV meanwhile and decodes once its prompt is in.
            start = max(self.now, e.pf_until)
            if start == self.now:
                e.pf_from = self.now       # a new busy spell of the prefill server
            e.pf_until = start + prefill
            e.pf[run] = (self.run_placed[run], work)
            e.pf_ctx += need
            self.push(e.pf_until, _PREFILLED, run, self.run_placed[run])
        else:
            self.decode(run, cid, work)
        if self.kv_cap:
            self.unpark(run)
            # Make room: evict the runs parked longest (their prefix is prefilled again later).
            while e.parked and e.ctx + e.parked_ctx > self.kv_cap:
                old = next(iter(e.parked))
                e.parked_ctx -= e.parked.pop(old)
                self.run_home[old] = -1
            self.run_home[run] = cid
        self.reschedule(cid)
        self.touch(self.cells[cid])
        if self.run_start[run] < 0:
            # The run's wall clock starts when it is first served, not when its batch
            # launched: time in the queue is the fleet's, not the run's.
            self.run_start[run] = self.now
            self.run_deadline[run] = self.now + self.w.run.timeout_s
            self.push(self.run_deadline[run], _DEADLINE, run)

    def decode(self, run: int, cid: int, work: float) -> None:
        e = self.engines[cid]
        if not e.heap:
            e.clock = 0.0  # keeps service clocks small; nothing depends on the old reading
        heapq.heappush(e.heap, (e.clock + work, run))
        e.ctx += self.ctx_of(run)

    def on_prefilled(self, run: int, placed: int) -> None:
        cid = self.run_where[run]
        if cid < 0 or self.run_placed[run] != placed:
            return   # moved or cut while prefilling
        e = self.engines[cid]
        self.advance(e)
        _, work = e.pf.pop(run)
        e.pf_ctx = e.pf_ctx - self.ctx_of(run) if e.pf else 0.0
        self.decode(run, cid, work)
        self.reschedule(cid)
        self.touch(self.cells[cid])

    def park(self, run: int, cid: int) -> None:
        """A call ended: its KV stays on the engine while the run is in its tool call."""
        e = self.engines[cid]
        ctx = self.ctx_of(run)
        e.parked[run] = ctx
        e.parked_ctx += ctx
        self.run_home[run] = cid
        self.run_cached[run] = ctx

    def unpark(self, run: int) -> None:
        home = self.run_home[run]
        if home >= 0:
            e = self.engines[home]
            if run in e.parked:
                e.parked_ctx -= e.parked.pop(run)
                if not e.parked:
                    e.parked_ctx = 0.0
            self.run_home[run] = -1

    def drain_queue(self) -> None:
        while self.queue:
            before = len(self.queue)
            run, work, warm, prefill = self.queue.popleft()
            self.route(run, work, front=True, warm=warm, prefill=prefill)
            if len(self.queue) >= before:
                break

    def ctx_of(self, run: int) -> float:
        b = self.batches[self.run_batch[run]]
        return b.ctx[run - self.run_base[b.step]][self.run_idx[run]]

    def on_engine(self, cid: int, stamp: int) -> None:
        e = self.engines[cid]
        if stamp != e.stamp:
            return
        self.advance(e)
        finished = []
        while e.heap and e.heap[0][0] - e.clock <= _EPS:
            finished.append(heapq.heappop(e.heap)[1])
        for run in finished:
            e.ctx -= self.ctx_of(run)
        if not e.heap:
            e.ctx = 0.0
        if self.kv_cap:
            for run in finished:
                self.park(run, cid)
        self.reschedule(cid)
        self.touch(self.cells[cid])
        for run in finished:
            self.call_done(run)
        self.drain_queue()

    # ---------------------------------------------------------------- runs
    def call_done(self, run: int) -> None:
        self.run_where[run] = _AWAY
        b = self.batches[self.run_batch[run]]
        i = run - self.run_base[b.step]
        k = self.run_idx[run]
        self.run_tokens[run] += b.tokens[i][k]
        k += 1
        self.run_idx[run] = k
        deadline = self.run_deadline[run]
        if k == len(b.work[i]) or self.now >= deadline:
            self.finish_run(run, cut=k < len(b.work[i]))
            return
        self.push(min(self.now + b.tool_s[i][k - 1], deadline), _TOOL, run)

    def on_tool(self, run: int) -> None:
        if self.run_done[run]:
            return
        if self.now >= self.run_deadline[run] - _EPS:
            self.finish_run(run, cut=True)
            return
        b = self.batches[self.run_batch[run]]
        i, k = run - self.run_base[b.step], self.run_idx[run]
        self.route(run, b.work[i][k], prefill=b.prefill_s[i][k])

    def on_deadline(self, run: int) -> None:
        """The run's wall-clock limit: whatever it is doing stops, and what it generated of
        the call in progress (in proportion to the decode work done) is kept."""
        if self.run_done[run]:
            return
        where = self.run_where[run]
        b = self.batches[self.run_batch[run]]
        i, k = run - self.run_base[b.step], self.run_idx[run]
        if where >= 0 and run in self.engines[where].pf:
            e = self.engines[where]       # cut while its prompt is prefilled: nothing generated
            self.advance(e)
            del e.pf[run]
            e.pf_ctx = e.pf_ctx - b.ctx[i][k] if e.pf else 0.0
            self.reschedule(where)
            self.touch(self.cells[where])
        elif where >= 0:
            e = self.engines[where]
            self.advance(e)
            pos = next(j for j, (_, r) in enumerate(e.heap) if r == run)
            left = max(e.heap[pos][0] - e.clock, 0.0)
            e.heap[pos] = e.heap[-1]
            e.heap.pop()
            heapq.heapify(e.heap)
            e.ctx = e.ctx - b.ctx[i][k] if e.heap else 0.0
            self.run_tokens[run] += b.tokens[i][k] * max(0.0, 1.0 - left / b.work[i][k])
            self.reschedule(where)
            self.touch(self.cells[where])
        elif where == _QUEUED:
            self.queue = deque(q for q in self.queue if q[0] != run)
        self.run_where[run] = _AWAY
        self.finish_run(run, cut=True)
        self.drain_queue()

    def finish_run(self, run: int, cut: bool) -> None:
        self.run_done[run] = True
        if self.kv_cap:
            self.unpark(run)
        step = self.run_batch[run]
        b = self.batches[step]
        g = (step, b.group[run - self.run_base[step]])
        self.runs_finished += 1
        self.runs_cut += cut
        i = run - self.run_base[step]
        self.run_rows.append(RunRow(
            time=self.now, step=step, run_id=f"s{step}-r{i}", task_id=f"s{step}-t{g[1]}",
            status="timeout" if cut else "finished", reward=float("nan"), wall_s=self.now - self.run_start[run],
            calls=min(self.run_idx[run] * self.w.run.coarsen, b.calls[i]), migrations=self.run_migrations[run],
            policy_version=self.batch_version[step]))
        self.longest_run_s = max(self.longest_run_s, self.now - self.run_start[run])
        trained = self.run_tokens[run] * self.w.run.trained_per_token   # what the trainer processes for it
        self.group_tokens[g] += trained
        self.finished_tokens += trained
        self.group_left[g] -= 1
        if self.group_left[g] == 0:
            # Advantages are normalised within the group, so its runs train once all are in.
            tokens = self.group_tokens.pop(g)
            self.trainer_advance()
            if step == self.version and not self.optimizing:
                self.tr_avail += tokens
            else:
                self.backlog[step] = self.backlog.get(step, 0.0) + tokens
            self.trainer_update()
        self.unfinished[step] -= 1
        self.active.discard(run)
        self.admit_runs()
        if self.unfinished[step] == 0:
            self.event_rows.append(EventRow(self.now, "rollout_done", step))
            self.trainer_update()
            self.try_start_batch()
            self.request_decision()

    def admit_runs(self) -> None:
        """Start launched runs while the harness pool has room; once a batch has all its runs
        started, the next may launch (if the staleness bound allows)."""
        while self.pending and len(self.active) < self.max_active:
            run = self.pending.popleft()
            self.active.add(run)
            b = self.batches[self.run_batch[run]]
            i = run - self.run_base[b.step]
            self.route(run, b.work[i][0], prefill=b.prefill_s[i][0])
        if not self.pending:
            self.try_start_batch()

    # ---------------------------------------------------------------- batches
    def try_start_batch(self) -> None:
        if (self.next_batch >= self.w.steps or self.launch_pending
                or not may_launch_batch(self.next_batch, self.version, self.staleness, not self.pending)):
            return
        self.launch_pending = True
        delay = self.w.train.weight_sync_s if self.engines_version != self.version else 0.0
        self.push(self.now + delay, _LAUNCH, self.next_batch)

    def on_launch(self, step: int) -> None:
        self.launch_pending = False
        self.engines_version = self.version
        b = self.given[step] if step in self.given else sample_batch(self.w, step)
        self.batches[step] = b
        base = len(self.run_batch)
        self.run_base[step] = base
        self.batch_version[step] = self.version
        self.unfinished[step] = b.runs
        for g in set(b.group):
            self.group_left[(step, g)] = 0
            self.group_tokens[(step, g)] = 0.0
        for g in b.group:
            self.group_left[(step, g)] += 1
        for i in range(b.runs):
            self.run_batch.append(step)
            self.run_idx.append(0)
            self.run_deadline.append(math.inf)   # set when first served
            self.run_tokens.append(0.0)
            self.run_start.append(-1.0)
            self.run_migrations.append(0)
            self.run_where.append(_AWAY)
            self.run_done.append(False)
            self.run_home.append(-1)
            self.run_cached.append(0.0)
            self.run_placed.append(0)
        self.next_batch = step + 1
        self.event_rows.append(EventRow(self.now, "batch_start", step, f"{b.runs} runs, weights v{self.version}"))
        self.pending.extend(range(base, base + b.runs))
        self.admit_runs()
        self.request_decision()

    # ---------------------------------------------------------------- trainer
    def trainer_advance(self) -> None:
        if self.tr_busy and not self.optimizing:
            d = min(self.tr_avail, self.tr_rate * (self.now - self.tr_t))
            self.tr_avail -= d
            self.trained[self.version] = self.trained.get(self.version, 0.0) + d
        self.tr_t = self.now

    def trainer_update(self) -> None:
        """After any change to replicas or trainable tokens: new rate, next drain, busy flag."""
        self.trainer_advance()
        replicas = sum(1 for c in self.cells if c.role is Role.TRAIN and not c.switching)
        t = self.w.train
        self.tr_rate = t.rate(replicas)
        self.tr_stamp += 1
        if self.tr_avail <= _EPS:
            self.tr_avail = 0.0
        if not self.optimizing and self.tr_avail > 0 and self.tr_rate > 0:
            self.push(self.now + self.tr_avail / self.tr_rate, _DRAIN, self.tr_stamp)
        elif (not self.optimizing and self.tr_avail == 0 and self.unfinished.get(self.version) == 0
              and self.version < self.w.steps and replicas > 0):
            # every group of this step is in and trained: the optimizer step ends it
            self.optimizing = True
            self.push(self.now + t.optimizer_step_s, _OPT)
        busy = self.optimizing or (self.tr_avail > 0 and self.tr_rate > 0)
        if busy != self.tr_busy:
            self.tr_busy = busy
            for c in self.cells:
                if c.role is Role.TRAIN and not c.switching:
                    self.touch(c)

    def on_drain(self, stamp: int) -> None:
        if stamp == self.tr_stamp:
            self.trainer_advance()
            self.tr_avail = 0.0
            self.trainer_update()

    def on_opt(self) -> None:
        step = self.version
        replicas = sum(1 for c in self.cells if c.role is Role.TRAIN and not c.switching)   # that applied it
        self.version += 1
        self.optimizing = False
        wall = self.now - self.last_step_end
        self.last_step_end = self.now
        self.step_s.append(wall)
        self.steps.append(StepRow(step=step, time=self.now, wall_s=wall, tokens=int(round(self.trained.get(step, 0.0))),
                                  replicas=replicas, policy_version=self.version))
        self.event_rows.append(EventRow(self.now, "step_done", step))
        if self.version >= self.w.steps:
            self.done = True
            return
        if self.observe_floor:
            self.set_observed_floor()
        self.tr_avail = self.backlog.pop(self.version, 0.0)
        self.trainer_update()
        self.try_start_batch()
        self.request_decision()

    def set_observed_floor(self) -> None:
        """After a step: what it measured (engine- and replica-seconds busy, its longest
        run) goes to ``sched.observed_floor``, and elastic holds the floor it gives."""
        acc = [sum(c.acc[k] + (self.now - c.since if c.cat == k else 0.0) for c in self.cells) for k in range(5)]
        d = [a - b for a, b in zip(acc, self.acc_at_step)]
        self.acc_at_step = acc
        self.floor_history.append(StepObservation(engine_busy_s=d[ROLLOUT_BUSY], train_busy_s=d[TRAIN_BUSY],
                                                  longest_run_s=self.longest_run_s))
        self.longest_run_s = 0.0
        self.hold_floor(observed_floor(self.floor_history, self.floor_range()))

    def floor_range(self) -> FloorRange:
        f = self.w.fleet
        return FloorRange(cells=f.cells, lowest=self.w.core_cells, highest=f.cells - 1 - f.rollout_only)

    def hold_floor(self, floor: int) -> None:
        self.floors.append(floor)
        self.policy = dataclasses.replace(self.policy, params=dataclasses.replace(self.policy.params,
                                                                                  train_floor_cells=floor))

    # ---------------------------------------------------------------- roles
    def request_decision(self) -> None:
        if not self.decide_pending:
            self.decide_pending = True
            self.push(self.now, _DECIDE, 0)

    def tail(self) -> set[int]:
        """The runs expected to finish last, ranked by the runtime's own estimator from what
        a controller observes (when each run started, its calls so far), never from the
        run's sampled future."""
        c = self.w.run.coarsen
        return tail_runs({run: RunProgress(self.run_start[run] if self.run_start[run] >= 0 else math.inf,
                                           self.run_idx[run] * c) for run in self.active}, self.w.tail_fraction)

    def cluster_state(self) -> ClusterState:
        tps = self.w.train.tokens_per_s
        tail = self.tail()
        tail_on: dict[int, int] = {}
        for run in tail:
            where = self.run_where[run]
            if where >= 0:
                tail_on[where] = tail_on.get(where, 0) + 1
        cells = []
        inflight = 0
        cache = self.cell_state_cache
        for c in self.cells:
            e = self.engines[c.id]
            n = e.resident
            inflight += n
            nt = tail_on.get(c.id, 0)
            key = (c.role, c.switching, n, int(e.ctx + e.pf_ctx + e.parked_ctx), nt, len(e.heap))
            hit = cache.get(c.id)
            if hit is None or hit[0] != key:
                # CellState is frozen; building 64 of them every epoch was a fifth of the run time
                hit = cache[c.id] = (key, CellState(
                    cell=c.id, kind=c.kind, role=c.role, switching=c.switching, inflight_requests=n,
                    inflight_tokens=int(e.ctx + e.pf_ctx + e.parked_ctx),
                    rollout_tokens_per_s=self.decode_tokens_per_s(e),
                    train_tokens_per_s=tps, tail_requests=nt, kv_capacity_tokens=self.kv_cap))
            cells.append(hit[1])
        self.trainer_advance()
        # The training step's own backlog, as the runtime counts it (``StepState.backlog_tokens``):
        # groups of a batch rolled out ahead train only after the update, so no cell could
        # train them before then.
        backlog = self.tr_avail + self.backlog.get(self.version, 0.0)
        # KV the fleet must keep for every started run, not only those decoding now: a run
        # back from a tool call resumes from its cached prefix instead of prefilling it again.
        tokens = sum(self.ctx_of(run) for run in self.active if self.run_start[run] >= 0)
        rolling = [self.batch_version[s] for s, n in self.unfinished.items() if n > 0]
        serving = sum(1 for c in self.cells if self.serving(c))
        demand = max(inflight + len(self.queue), len(self.active))
        if self.queue or demand > self.target * serving:
            if self.over_since is None:
                self.over_since = self.now
        else:
            self.over_since = None
        return ClusterState(
            time=self.now, step=self.version, cells=tuple(cells),
            unfinished_runs=sum(self.unfinished.values()), queued_requests=len(self.queue),
            inflight_requests=inflight, tokens_inflight=int(tokens), train_backlog_tokens=int(backlog),
            policy_version=self.version, oldest_rollout_version=min(rolling, default=self.version),
            demand_over_capacity_s=self.now - self.over_since if self.over_since is not None else 0.0,
            tail_runs=len(tail),
            next_batch_waits=next_batch_waits(not self.pending and not self.launch_pending, self.next_batch,
                                              self.version, self.staleness, self.w.steps),
            # What the training step's own open runs will add (the runtime's TrainQueue.expected_tokens):
            # runs of a batch rolled out ahead train after the update.
            expected_train_tokens=int(self.unfinished.get(self.version, 0) * self.finished_tokens / self.runs_finished)
            if self.runs_finished else 0,
            # What a release costs: in place, every engine holding the last update's weights.
            rollout_to_train_s=self.w.fleet.join_s(True),
            train_to_rollout_s=self.w.fleet.train_to_rollout_s)

    def on_decide(self, periodic: int) -> None:
        if periodic:
            if not self.done:
                self.push(self.now + self.w.decision_interval_s, _DECIDE, 1)
        else:
            self.decide_pending = False
        self.apply(self.policy(self.cluster_state()), cost=True)

    def apply(self, changes: list[RoleChange], cost: bool) -> None:
        f = self.w.fleet
        touched_trainer = False
        for ch in changes:
            if not 0 <= ch.cell < len(self.cells):
                raise SimError(f"policy {self.name!r} flipped cell {ch.cell}: the fleet has cells 0..{len(self.cells) - 1}")
            c = self.cells[ch.cell]
            if c.kind is not CellKind.ELASTIC:
                raise SimError(f"policy {self.name!r} flipped cell {c.id}, a {c.kind.value} cell: only elastic cells flip")
            if c.switching:
                raise SimError(f"policy {self.name!r} flipped cell {c.id} while its previous flip is in progress")
            if c.role is ch.to:
                continue
            was = c.role
            c.role = ch.to
            in_place = ch.to is Role.TRAIN
            dur = (f.join_s(in_place) if ch.to is Role.TRAIN else f.train_to_rollout_s) if cost else 0.0
            self.switch_dur[c.id] = (dur, in_place)
            c.switching = dur > 0
            if was is Role.ROLLOUT:
                self.release_engine(c.id)
            touched_trainer = True
            self.switches += int(cost)
            if cost:
                self.timeline.append(TimelineRow(self.now, c.id, "SWITCH", "switch", self.version, dur, 0,
                                                 f"{was.value}->{ch.to.value}: {ch.reason}"[:160]))
                self.push(self.now + dur, _SWITCH, c.id)
            else:
                self.timeline.append(TimelineRow(self.now, c.id, ch.to.value, "role", self.version, 0.0, 0,
                                                 f"initial placement: {ch.reason}"[:160]))
                self.reschedule(c.id)
            self.touch(c)
        if touched_trainer:
            self.trainer_update()
            self.drain_queue()

    def release_engine(self, cid: int) -> None:
        """Its in-flight sequences move, with the work they have left, to the other engines."""
        e = self.engines[cid]
        self.advance(e)
        moved = [(run, max(fin - e.clock, 0.0)) for fin, run in sorted(e.heap)]
        e.heap.clear()
        e.ctx = 0.0
        # Calls still prefilling move too; their prompt is prefilled again where they land.
        b_of = self.batches
        prefilling = []
        for run, (_, work) in e.pf.items():
            b = b_of[self.run_batch[run]]
            prefilling.append((run, work, b.prefill_s[run - self.run_base[b.step]][self.run_idx[run]]))
        e.pf.clear()
        e.pf_ctx = 0.0
        e.pf_until = self.now
        # Runs away in a tool call take their cached prefix along too: no prefill on return.
        for run in e.parked:
            self.run_home[run] = -1
            self.run_cached[run] = 0.0
        e.parked.clear()
        e.parked_ctx = 0.0
        self.reschedule(cid)
        for run, left in moved:
            self.run_migrations[run] += 1
            self.route(run, left, front=True, warm=True)
        for run, work, prefill in prefilling:
            self.run_migrations[run] += 1
            self.route(run, work, front=True, warm=True, prefill=prefill)

    def on_switch(self, cid: int) -> None:
        c = self.cells[cid]
        c.switching = False
        dur, in_place = self.switch_dur.get(cid, (0.0, False))
        # "in place" as the runtime's flip_end rows say it (sim.measure tells the two joins apart)
        self.timeline.append(TimelineRow(self.now, cid, c.role.value, "role", self.version, dur, 0,
                                         "in place" if in_place else ""))
        self.reschedule(cid)
        self.touch(c)
        self.trainer_update()
        if c.role is Role.ROLLOUT and not self.route_pending:
            # Route the queue once every switch ending at this instant has ended: engines that
            # come up together share the waiting calls, least loaded first, as the runtime's
            # router spreads a batch over the engines one flip opened; draining at the first
            # of them gave it every call its slots held.
            self.route_pending = True
            self.push(self.now, _ROUTE)
        self.request_decision()

    def on_route(self) -> None:
        self.route_pending = False
        self.drain_queue()

    def on_sample(self) -> None:
        if self.done:
            return
        per_replica = self.tr_rate / max(1, sum(1 for c in self.cells if c.role is Role.TRAIN and not c.switching))
        for c in self.cells:
            e = self.engines[c.id]
            n = len(e.heap)   # sequences decoding (a call prefilling moves no decode tokens)
            if c.switching:
                tps = 0.0
            elif c.role is Role.ROLLOUT:
                tps = self.decode_tokens_per_s(e)
            else:
                # A replica's "in flight" is the work in hand: a micro-batch, or the optimizer
                # step (which moves no tokens but keeps the GPUs busy).
                tps = per_replica if (self.tr_busy and not self.optimizing) else 0.0
                n = int(self.tr_busy)
            self.engine_rows.append(EngineRow(self.now, c.id, tps, len(self.queue) if c.role is Role.ROLLOUT else 0,
                                              n, int(e.ctx)))
        self.push(self.now + self.w.engine_sample_s, _SAMPLE)

    # ---------------------------------------------------------------- main loop
    def run(self) -> SimResult:
        t0 = wallclock.perf_counter()
        self.loop(math.inf)
        return self.result(t0)

    def finishes_by(self, limit_s: float) -> float | None:
        """The total time if the run ends by ``limit_s`` (every event identical to ``run``'s),
        else None, stopped at the first event past it: a search for the fastest
        configuration need not finish a trial once it is slower than the best so far."""
        return self.now if self.loop(limit_s) else None

    def loop(self, limit_s: float) -> bool:
        for c in self.cells:
            self.timeline.append(TimelineRow(0.0, c.id, c.role.value, "start", 0, 0.0, 0, c.kind.value))
            self.touch(c)
        # Initial placement: whatever the policy wants before any work exists is where the
        # cells start (the runtime's config does the same with cells.initial_train), free.
        self.apply(self.policy(self.cluster_state()), cost=False)
        for c in self.cells:
            self.reschedule(c.id)
        self.trainer_update()
        self.push(0.0, _SAMPLE)
        self.push(self.w.decision_interval_s, _DECIDE, 1)
        self.try_start_batch()
        events = self.events
        on_engine, on_tool, on_deadline, on_prefilled = self.on_engine, self.on_tool, self.on_deadline, self.on_prefilled
        rare = {_SWITCH: lambda a, b: self.on_switch(a), _DRAIN: lambda a, b: self.on_drain(a),
                _OPT: lambda a, b: self.on_opt(), _DECIDE: lambda a, b: self.on_decide(a),
                _LAUNCH: lambda a, b: self.on_launch(a), _SAMPLE: lambda a, b: self.on_sample(),
                _ROUTE: lambda a, b: self.on_route()}
        n = 0
        while events and not self.done:
            t, _, kind, a, b = heapq.heappop(events)
            if t > limit_s:
                self.n_events = n
                return False
            self.now = t
            n += 1
            # the four kinds that make up nearly all events are dispatched without a lookup
            if kind == _ENGINE:
                on_engine(a, b)
            elif kind == _TOOL:
                on_tool(a)
            elif kind == _PREFILLED:
                on_prefilled(a, b)
            elif kind == _DEADLINE:
                on_deadline(a)
            else:
                rare[kind](a, b)
        self.n_events = n
        if not self.done:
            raise SimError(f"policy {self.name!r}: the simulation stalled at t={self.now:.1f}s after "
                           f"{len(self.step_s)} of {self.w.steps} steps (no trainer, or no engine for queued work)")
        return True

    def result(self, t0: float) -> SimResult:
        for c in self.cells:
            c.acc[c.cat] += self.now - c.since
            c.since = self.now
            self.timeline.append(TimelineRow(self.now, c.id, c.role.value, "end", self.version))
        self.event_rows.append(EventRow(self.now, "finish", self.version - 1, f"simulated, policy {self.name}"))
        total = sum(sum(c.acc) for c in self.cells)
        acc = [sum(c.acc[k] for c in self.cells) for k in range(5)]
        busy = {"rollout": acc[ROLLOUT_BUSY] / total, "train": acc[TRAIN_BUSY] / total,
                "switch": acc[SWITCH] / total, "idle": (acc[ROLLOUT_IDLE] + acc[TRAIN_IDLE]) / total}
        for e in self.engines:
            self.advance(e)
        seq_s = sum(e.seq_s for e in self.engines)
        serving_s = acc[ROLLOUT_BUSY] + acc[ROLLOUT_IDLE]
        slots = self.w.engine.max_seqs
        # "busy" counts an engine with one sequence as busy; occupancy says how full it was.
        occupancy = {
            "slots_of_serving": seq_s / (slots * serving_s) if serving_s else 0.0,
            "slots_of_busy": seq_s / (slots * acc[ROLLOUT_BUSY]) if acc[ROLLOUT_BUSY] else 0.0,
            "mean_seqs_when_busy": seq_s / acc[ROLLOUT_BUSY] if acc[ROLLOUT_BUSY] else 0.0,
            "kv_of_serving": (sum(e.kv_s for e in self.engines) / (self.kv_cap * serving_s)
                              if self.kv_cap and serving_s else 0.0),
        }
        return SimResult(
            policy=self.name, workload=self.w.name, total_s=self.now, step_s=self.step_s, busy=busy,
            switches=self.switches, runs_finished=self.runs_finished, runs_cut=self.runs_cut,
            tokens_trained=sum(self.trained.values()), events=self.n_events, occupancy=occupancy,
            sim_wall_s=wallclock.perf_counter() - t0, timeline=self.timeline, steps=self.steps,
            engines=self.engine_rows, events_log=self.event_rows, runs=self.run_rows)


def simulate(w: Workload, policy: Policy, policy_name: str, batches: Mapping[int, Batch] | None = None) -> SimResult:
    return FleetSim(w, policy, policy_name, batches).run()


def policy_for(w: Workload, name: str, **params) -> Policy:
    """The registry's policy (any name ``gyre_hpc.sched.registry`` knows), with the inputs
    the workload knows better: async's configured split, and elastic's parameters sized from
    the workload's engine and trainer (``sched.elastic.device_sized``, as a fleet of paced
    cells sizes them) with ``w.policy.elastic``'s set fields and ``params`` over them."""
    import dataclasses

    from gyre_hpc.sched.elastic import ElasticParams, ElasticPolicy, device_sized
    from gyre_hpc.sched.registry import get_policy
    if name == "async":
        params.setdefault("train_cells", w.async_split())
        params.setdefault("max_staleness", w.fleet.async_max_staleness)
    elif name == "elastic":
        default, given = ElasticParams(), w.policy.elastic
        for f in dataclasses.fields(ElasticParams):
            if getattr(given, f.name) != getattr(default, f.name):
                params.setdefault(f.name, getattr(given, f.name))
        get_policy(name, **params)     # unknown names fail as the registry words it
        return ElasticPolicy(device_sized(w.engine, w.train, params))
    return get_policy(name, **params)

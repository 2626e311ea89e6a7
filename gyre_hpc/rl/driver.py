"""The RL workload's step driver on rank 0: harness runs, routing, trees, streaming training.

It drives each step through the one fleet controller (``cells.controller.Controller``):
every command goes out with ``send``/``broadcast`` and every reply comes back through
``poll_replies``/``collect``, so a silent replica fails the fleet within the reply timeout,
naming the rank and the command it owed. Flips, checkpoints and the stop are the
controller's. One asyncio loop on one thread does everything that touches MPI on this rank. Each agent
run is a task (``harness.loop.AgentRun``) whose model calls go through ``RouterDriver`` to
the ROLLOUT engines; tools and checkers run in worker threads, so the loop keeps pumping
(``_pump``): engine token streams, replicas' micro-batch reports, policy decisions, and
dealing micro-batches. A step:

1. sample ``rollout.tasks_per_step`` tasks (seeded by run seed and step) and start
   ``rollout.runs_per_task`` runs of each (run ids ``s<step>-t<k>-g<g>``, seeds derived);
2. as an advantage group's runs finish (or time out: the harness scores the workspace as
   it is), build their trees, admit them (``train.max_paths_per_run``), append the group to
   ``trees.zarr`` (one commit; this rank is the store's only writer) and cut it into
   micro-batches that go to the TRAIN replicas by measured speed while other runs still roll out;
3. every ``scheduler.interval_s`` the policy sees a ClusterState built from live counters
   and may flip cells. ROLLOUT -> TRAIN first drains the engine through the router (in-flight
   sequences move with their KV cache and continue on the remaining engines), then all ranks
   meet in ``Controller.flip`` (re-derived train_comm; weights AND optimizer
   state from the core cell). A replica that leaves TRAIN mid-step hands its micro-batches
   back; the others redo them;
4. once every run is done and every micro-batch trained: allreduce, optimizer step (version
   + 1), new weights to every engine, step and run rows to ``metrics.h5``, checkpoint.

Exactly-once trees across a kill: the checkpoint records how many committed trees the model
has trained on (``trained_upto``). A relaunch trains the steps after the checkpoint; trees of
those steps already in the store (committed before the kill) are read back instead of being
rolled out again, and runs not in the store resume from their journals. Step and run rows
are written when a checkpoint seals their step, so a redone step has one row.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gyre_hpc.cells.controller import Controller, FlipRecord
from gyre_hpc.cells.plan import Cell, core_cell, train_ranks
from gyre_hpc.engines.mpi_engines import MPIEngines
from gyre_hpc.engines.router import Router
from gyre_hpc.harness.loop import AgentRun, HarnessConfig, RunResult
from gyre_hpc.rl import messages
from gyre_hpc.rl.batches import MicroBatchRef, ReplicaSpeeds, admit_group, group_micro_batches, group_refs, pick_replica
from gyre_hpc.rl.latency import LatencyAgentRun
from gyre_hpc.rl.policy_inputs import DemandClock, run_of_request, tail_runs
from gyre_hpc.rl.router_client import CountingRunClient, RouterDriver
from gyre_hpc.rl.runs import RunSpec, sample_runs
from gyre_hpc.rl.tasks import load_tasks
from gyre_hpc.rl.trainer import policy_tokenizer
from gyre_hpc.rundir.metrics import EngineRow, RunRow, StepRow, TimelineRow
from gyre_hpc.sched.staleness import may_launch_batch, staleness_bound
from gyre_hpc.sched.state import CellState, ClusterState, Role, RoleChange
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.loss import LogprobGap, run_targets, step_denominator
from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.store import TreeStore

OPTIMIZER_FILES = ["model.safetensors", "config.json", "optimizer.safetensors"]
STEP_ROWS_FILE = "metrics_rows.json"   # the steps/runs rows of the steps a checkpoint seals


def restore_step_rows(directory: Path, metrics_path: Path) -> list:
    """Rows of the steps a checkpoint sealed that are missing from ``metrics.h5`` (a kill
    between the checkpoint's commit and the rows' append); [] when they are there or were
    never saved. A step's rows are appended together, so a step is there whole or not at all."""
    from gyre_hpc.rundir.metrics import read_table

    path = Path(directory) / STEP_ROWS_FILE
    if not path.is_file():
        return []
    kinds = {"RunRow": RunRow, "StepRow": StepRow}
    rows = [kinds[kind](**fields) for kind, fields in json.loads(path.read_text())]
    recorded = set(int(s) for s in read_table(metrics_path, "steps")["step"]) if metrics_path.exists() else set()
    return [r for r in rows if r.step not in recorded]


class CountingEngines(MPIEngines):
    """MPIEngines that also counts each engine's decoded tokens (its measured throughput)
    and the prefill it did beyond first prefills, and can pause an engine's serve loop so
    its rank can join a world-wide collective.

    Recomputed prefill: every engine reports its cumulative ``prefill_tokens`` with the
    events of the same decode step, and a request's first prefill is the step that produced
    its token 0. A prompt's tokens reach a cache either through the model (``prefill_tokens``)
    or from its session's retained context (``cached_prompt_tokens``), each exactly once for
    a request that starts and finishes on one engine. So (sum of the engines' prefill +
    cached) - (prompt tokens of the requests whose token 0 was seen) is exactly the prefill
    done again: a moved sequence whose cache did not travel re-fills prompt + output without
    a token 0. Valid for engines that prefill a prompt in the step that samples its first
    token (TorchEngine without a prefill budget)."""

    def __init__(self, comm, ranks, poll_timeout_s: float = 0.0, reply_timeout_s: float = 600.0):
        super().__init__(comm, ranks, poll_timeout_s, reply_timeout_s)
        self.tokens = {e: 0 for e in self.ranks}
        self.prefill = {e: 0 for e in self.ranks}     # engine -> cumulative prefill tokens reported
        self.cached = {e: 0 for e in self.ranks}      # engine -> cumulative prompt tokens served from retained contexts
        self.first_prefill = 0                        # prompt tokens of requests whose token 0 was seen
        self._prompt_len: dict[str, int] = {}         # submitted, token 0 not seen yet

    def submit(self, engine: int, request) -> None:
        self._prompt_len[request.request_id] = request.prompt_len
        super().submit(engine, request)

    def poll(self):
        reports = super().poll()
        for r in reports:
            self.tokens[r.engine] += len(r.events)
            if r.prefill_tokens >= 0:
                self.prefill[r.engine] = r.prefill_tokens
            if r.cached_prompt_tokens >= 0:
                self.cached[r.engine] = r.cached_prompt_tokens
            for ev in r.events:
                if ev.index == 0:
                    self.first_prefill += self._prompt_len.pop(ev.request_id, 0)
        return reports

    @property
    def recomputed_prefill_tokens(self) -> int:
        return sum(self.prefill.values()) + sum(self.cached.values()) - self.first_prefill

    def pause(self, engines) -> dict:
        """Each paused engine's counters (the ``stop`` reply)."""
        return {e: self.call(e, "stop") for e in engines}


@dataclass
class RunOutcome:
    spec: RunSpec
    tree: Tree
    migrations: int = 0
    restarts: int = 0
    calls: int = 0
    model_s: float = 0.0
    from_store: bool = False
    store_index: int = -1


@dataclass
class StepState:
    step: int
    specs: list[RunSpec]
    outcomes: dict[str, RunOutcome] = field(default_factory=dict)
    pending: list[MicroBatchRef] = field(default_factory=list)
    outstanding: dict[int, list[MicroBatchRef]] = field(default_factory=dict)   # rank -> sent, unreported
    done_by: dict[int, list[MicroBatchRef]] = field(default_factory=dict)       # rank -> trained this step
    losses: dict[int, float] = field(default_factory=dict)                   # mb id -> loss
    gaps: dict[int, LogprobGap] = field(default_factory=dict)                # mb id -> its logprob gap
    store_end: int = 0          # one past the highest store index of this step's trees
    trained_tokens: int = 0
    next_mb: int = 0
    groups_done: set[int] = field(default_factory=set)
    groups_changed: bool = False
    start_version: int = 0      # the trainer's newest version when the step's rollouts began
    flips: list[FlipRecord] = field(default_factory=list)
    migrations: list[tuple[int, int, int, float]] = field(default_factory=list)  # (cell, requests, bytes, s)
    run_started: dict[str, float] = field(default_factory=dict)   # run id -> unix time it took its place
    # False while the step's runs roll out ahead of it (async: during the previous step's
    # training); its finished groups wait in ``held`` so the store stays in step order.
    active: bool = True
    held: list[list[RunOutcome]] = field(default_factory=list)

    @property
    def runs_done(self) -> bool:
        return len(self.outcomes) == len(self.specs)

    @property
    def unfinished(self) -> int:
        return len(self.specs) - len(self.outcomes)

    def backlog_tokens(self) -> int:
        return sum(mb.tokens for mb in self.pending) + sum(mb.tokens for v in self.outstanding.values() for mb in v)


@dataclass(frozen=True)
class RLStepRecord:
    step: int
    wall_s: float
    loss: float
    reward_mean: float
    tokens: int
    policy_version: int
    train_cells: tuple[int, ...]
    runs: int
    migrations: int
    restarts: int
    flips: int
    optimizer_s: float = 0.0      # allreduce + optimizer step, as the controller waited for it
    weight_sync_s: float = 0.0    # new weights into every serving engine
    weight_sync_bytes: int = 0    # bytes each engine received
    checksums: dict[int, str] | None = None
    recomputed_prefill_tokens: int = 0   # prefill the engines did again during the step (0 with KV migration)
    gap: LogprobGap = field(default_factory=LogprobGap)   # trainer vs behaviour logprobs, before the update


# A flip to TRAIN moves the trainer's state: the weights and AdamW's two moments, 3x the bytes
# of the weights the engines receive after each step. Until this fleet has flipped a cell,
# the switch costs are planned from its own measured weight broadcast at this ratio.
STATE_BYTES_PER_WEIGHT_BYTE = 3


class RLStepDriver:
    def __init__(self, fleet: Controller, engine_comm, store: TreeStore, trained_upto: int, max_batch: int = 64):
        self.fleet = fleet
        self.max_batch = max_batch
        self.cfg, self.run, self.metrics, self.store = fleet.cfg, fleet.run, fleet.metrics, store
        self.trained_upto = trained_upto
        self.transport = CountingEngines(engine_comm, {c.id: c.leader for c in fleet.cells},
                                         reply_timeout_s=fleet.reply_timeout_s)
        self.router = Router(self.transport, [c.id for c in fleet.cells if c.role is Role.ROLLOUT])
        self.driver = RouterDriver(self.router, temperature=self.cfg.rollout.temperature,
                                   top_p=self.cfg.rollout.top_p)
        self.tasks = load_tasks(self.cfg.rollout.tasks)
        self.harness_cfg = HarnessConfig.from_rollout(self.cfg.rollout)
        self.tokenizer = policy_tokenizer(self.cfg)   # prompts in the policy's own chat template
        self.speeds = ReplicaSpeeds()
        self.serving: set[int] = set()
        self.engine_counters: dict[int, object] = {}   # engine -> counters at its last pause
        self.switch_s = {Role.TRAIN: None, Role.ROLLOUT: None}   # measured flip costs by target role
        self._engine_mark = (time.monotonic(), dict(self.transport.tokens))
        self._engine_rate: dict[int, float] = {}
        self._trained_in_window: dict[int, int] = {}
        self._inflight_integral: dict[int, float] = {}   # engine -> sum of requests held x seconds
        self._last_pump = time.monotonic()
        self._step_rows: list = []      # metrics rows of the steps no checkpoint has sealed yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self.demand = DemandClock(self.engine_capacity_requests())
        self._next: tuple[StepState, list[asyncio.Task]] | None = None   # the next step, rolling out ahead
        self._pool: asyncio.Semaphore | None = None   # the harness pool: places for one step's runs
        self._weights_push_s: float | None = None    # the latest measured weight broadcast to the engines
        self._run_tokens = (0, 0)                    # (training tokens, runs) of the groups committed so far
        self._recomputed_mark = 0                    # recomputed prefill counted in earlier steps

    @property
    def policy_version(self) -> int:
        return self.fleet.policy_version

    @property
    def result(self):
        return self.fleet.result

    @property
    def cells(self) -> tuple[Cell, ...]:
        return self.fleet.cells

    def cell(self, cid: int) -> Cell:
        return self.fleet.cell(cid)

    # ---- engines: serve / pause ----------------------------------------------------------
    def resume_engines(self) -> None:
        opening = [c for c in self.cells if c.role is Role.ROLLOUT and c.id not in self.serving]
        for c in opening:
            self.fleet.send(c.leader, messages.Serve(self.policy_version))
        self.fleet.collect([c.leader for c in opening])     # each acks, then serves its engine
        for c in opening:
            self.transport.resume(c.id)
            self.serving.add(c.id)

    def pause_engines(self, engines: list[int] | None = None) -> None:
        """Stop these engines' serve loops (default: all serving) so their ranks take fleet commands."""
        engines = sorted(self.serving if engines is None else engines)
        self.engine_counters.update(self.transport.pause(engines))
        self.serving -= set(engines)

    # ---- the run of one step -------------------------------------------------------------
    def sample_runs(self, step: int) -> list[RunSpec]:
        return sample_runs(self.tasks, self.cfg, step)

    def stored_trees(self, step: int) -> dict[str, tuple[int, Tree]]:
        """Trees of ``step`` committed after the last checkpoint (a kill came before training
        them), with their store indices."""
        prefix = f"s{step:05d}-"
        ids = self.store.run_ids()
        return {rid: (i, self.store.read(i)) for i, rid in enumerate(ids)
                if i >= self.trained_upto and rid.startswith(prefix)}

    async def _agent(self, spec: RunSpec, st: StepState) -> None:
        # The harness pool (one step's runs): a run rolled out ahead (async) starts when a run
        # of the current step finishes and frees its place, as in the simulator.
        async with self._pool:
            await self._agent_run(spec, st)

    async def _agent_run(self, spec: RunSpec, st: StepState) -> None:
        st.run_started[spec.run_id] = time.time()
        client: CountingRunClient = self.driver.client(spec.run_id, spec.seed)
        args = (spec.task, self.run.workspaces / spec.run_id, client, self.run.journals / f"{spec.run_id}.journal",
                self.harness_cfg)
        rc = self.cfg.rollout
        if rc.tool_latency_s > 0:
            agent = LatencyAgentRun(*args, run_id=spec.run_id, run_seed=spec.seed, median_s=rc.tool_latency_s,
                                    sigma=rc.tool_latency_sigma, tokenizer=self.tokenizer)
        else:
            agent = AgentRun(*args, run_id=spec.run_id, tokenizer=self.tokenizer)
        try:
            result: RunResult = await agent.run(resume=True)
        finally:
            self.driver.forget_run(spec.run_id)     # its contexts are dead: no memory, no migration
        versions = [c.policy_version for c in result.calls]
        tree = build_tree(result.calls, run_id=spec.run_id, task_id=spec.task.task_id, reward=result.reward,
                          status=result.status, policy_version=min(versions) if versions else self.policy_version,
                          wall_s=result.wall_s)
        self._run_done(st, RunOutcome(spec, tree, client.migrations, client.restarts, client.calls,
                                          client.model_s))

    def _run_done(self, st: StepState, outcome: RunOutcome) -> None:
        st.outcomes[outcome.spec.run_id] = outcome
        group = outcome.spec.group
        members = [s for s in st.specs if s.group == group]
        if group in st.groups_done or any(s.run_id not in st.outcomes for s in members):
            return
        st.groups_done.add(group)
        outs = [st.outcomes[s.run_id] for s in members]
        if not st.active:
            st.held.append(outs)    # rolled out ahead (async): committed once its step is the current one
            return
        self._commit_group(st, outs)

    def _commit_group(self, st: StepState, outs: list[RunOutcome]) -> None:
        """Admit, append to the store (one commit), cut into micro-batches for the replicas."""
        if all(o.from_store for o in outs):
            trees = [o.tree for o in outs]
            indices = [o.store_index for o in outs]
        else:
            trees = admit_group([o.tree for o in outs], self.cfg.train.max_paths_per_run)
            indices = list(self.store.append(trees))
            for o, t in zip(outs, trees):
                o.tree = t
        # Packed here only for the token counts that dealing needs; replicas read the trees
        # from the store by these indices and pack them the same way (pure function).
        tc = self.cfg.train
        mbs = group_micro_batches(trees, st.step, st.next_mb, tc.row_tokens, tc.micro_batch_tokens,
                                  tc.shared_targets, tc.averaging, tc.group_forest)
        st.next_mb += len(mbs)
        st.store_end = max([st.store_end, *(i + 1 for i in indices)])
        st.pending.extend(group_refs(indices, mbs))
        st.groups_changed = True
        tokens, runs = self._run_tokens
        self._run_tokens = (tokens + sum(mb.tokens for mb in mbs), runs + len(outs))

    # ---- replicas ------------------------------------------------------------------------
    def _deal(self, st: StepState) -> None:
        replicas = train_ranks(self.cells)
        while st.pending:
            free = [r for r in replicas if len(st.outstanding.get(r, [])) < 2]
            if not free:
                return
            held = {r: sum(mb.tokens for mb in st.outstanding.get(r, [])) for r in free}
            mb = st.pending.pop(0)
            rank = pick_replica(free, held, self.speeds, mb.tokens)
            st.outstanding.setdefault(rank, []).append(mb)
            self.fleet.send(rank, messages.Train(mb))    # a MicroBatchRef: indices, not trees

    def _poll_train(self, st: StepState, block: bool = False) -> None:
        """Take the replicas' micro-batch reports; ``block``: until none is outstanding."""
        while any(st.outstanding.values()):
            replies = self.fleet.poll_replies()
            for rank, rep in replies:
                if not isinstance(rep, messages.TrainReport):
                    raise RuntimeError(f"controller expected a TrainReport, got {type(rep).__name__} from rank {rank}")
                held = st.outstanding[rep.rank]
                mb = next(m for m in held if m.mb_id == rep.mb_id)
                held.remove(mb)
                st.done_by.setdefault(rep.rank, []).append(mb)
                st.losses[mb.mb_id] = rep.loss
                st.gaps[mb.mb_id] = rep.gap
                self.speeds.record(rep.rank, rep.tokens, rep.seconds)
                self._trained_in_window[rep.rank] = self._trained_in_window.get(rep.rank, 0) + rep.tokens
            if not block:
                return
            if not replies:
                time.sleep(0.0005)

    # ---- policy --------------------------------------------------------------------------
    def engine_capacity_requests(self) -> int:
        """Requests one engine holds at the target occupancy: the policy's own target when it
        has one (elastic), else the engine's continuous-batching width."""
        params = getattr(self.fleet.policy, "params", None)
        return int(getattr(params, "target_requests_per_engine", 0) or self.max_batch)

    def cluster_state(self, st: StepState) -> ClusterState:
        self._sample_cells(st)
        inflight = self.router.inflight()
        queued = len(self.driver.queue)
        # Runs not started yet (their tasks have not run) count as open, youngest of all.
        tail = tail_runs({s.run_id: st.run_started.get(s.run_id, math.inf) for s in st.specs}, st.outcomes)
        serving = [c for c in self.cells if c.role is Role.ROLLOUT and c.id in self.router.engines]
        # Cells that never trained (or never served) plan with what the others measured:
        # the cells are alike, so the first micro-batch (engine window) is the prior.
        measured_train = [r for r in self.speeds.rates.values() if r > 0]
        measured_engine = [r for r in self._engine_rate.values() if r > 0]
        train_prior = statistics.median(measured_train) if measured_train else 0.0
        engine_prior = statistics.median(measured_engine) if measured_engine else 0.0

        def tail_on(cid: int) -> int:
            return sum(1 for rid in self.router.inflight(cid) if run_of_request(rid) in tail)

        cells = tuple(CellState(
            cell=c.id, kind=c.kind, role=c.role,
            inflight_requests=len(self.router.inflight(c.id)) if c.role is Role.ROLLOUT else 0,
            inflight_tokens=self.router.outstanding_tokens(c.id) if c.role is Role.ROLLOUT else 0,
            rollout_tokens_per_s=self._engine_rate.get(c.id, 0.0) or engine_prior,
            train_tokens_per_s=sum(self.speeds.rates.get(r, 0.0) for r in c.ranks) or train_prior * len(c.ranks),
            tail_requests=tail_on(c.id) if c.role is Role.ROLLOUT else 0) for c in self.cells)
        extra = self.switch_costs()
        tokens, runs = self._run_tokens
        return ClusterState(time=time.time(), step=st.step, cells=cells, unfinished_runs=st.unfinished,
                            queued_requests=queued, inflight_requests=len(inflight),
                            tokens_inflight=sum(self.router.outstanding_tokens(e) for e in self.router.engines),
                            train_backlog_tokens=st.backlog_tokens(),
                            expected_train_tokens=int(st.unfinished * tokens / runs) if runs else 0,
                            policy_version=self.policy_version,
                            oldest_rollout_version=self.policy_version,
                            demand_over_capacity_s=self.demand.update(time.monotonic(), queued, len(inflight),
                                                                      len(serving)),
                            tail_runs=len(tail), **extra)

    def switch_costs(self) -> dict[str, float]:
        """The flip costs the policy plans with: this fleet's own last flip each way; before
        one, its measured weight broadcast (x ``STATE_BYTES_PER_WEIGHT_BYTE`` to TRAIN, where
        the optimizer state moves too); before that, nothing (the state's defaults)."""
        out = {}
        push = self._weights_push_s
        for role, key, prior in ((Role.TRAIN, "rollout_to_train_s", STATE_BYTES_PER_WEIGHT_BYTE),
                                 (Role.ROLLOUT, "train_to_rollout_s", 1)):
            if self.switch_s[role] is not None:
                out[key] = self.switch_s[role]
            elif push is not None:
                out[key] = prior * push
        return out

    @property
    def plans_from_rates(self) -> bool:
        """A policy that weighs switches against training rates (elastic)."""
        return hasattr(getattr(self.fleet.policy, "params", None), "default_train_tokens_per_s")

    def _sample_cells(self, st: StepState) -> None:
        """About once a second, one ``engines`` row per cell: an engine's decode tokens/s and
        requests in flight; a replica's measured training tokens/s while it had work (0 when
        it had none) and micro-batches in hand. The loader and the simulator's ``measure``
        read busy fractions and speeds from these rows."""
        now = time.monotonic()
        t0, marks = self._engine_mark
        if now - t0 < 1.0:
            return
        self._engine_rate = {e: (self.transport.tokens[e] - marks.get(e, 0)) / (now - t0) for e in marks}
        self._engine_mark = (now, dict(self.transport.tokens))
        rows = []
        for c in self.cells:
            if c.role is Role.ROLLOUT:
                # Requests held on average over the same window as the rate, so the pair
                # (batch, tokens/s) describes one regime (an instantaneous count would not).
                held = self._inflight_integral.get(c.id, 0.0) / (now - t0)
                rows.append(EngineRow(time=time.time(), cell=c.id, tokens_per_s=self._engine_rate.get(c.id, 0.0),
                                      inflight=int(round(held)),
                                      tokens_inflight=self.router.outstanding_tokens(c.id)))
            else:
                worked = any(self._trained_in_window.get(r, 0) for r in c.ranks) or \
                    any(st.outstanding.get(r) for r in c.ranks)
                rate = sum(self.speeds.rate(r) for r in c.ranks) if worked else 0.0
                rows.append(EngineRow(time=time.time(), cell=c.id, tokens_per_s=rate,
                                      inflight=sum(len(st.outstanding.get(r, [])) for r in c.ranks)))
        self._trained_in_window = {}
        self._inflight_integral = {}
        self.metrics.append(rows)

    def consult(self, st: StepState) -> list[FlipRecord]:
        if self.plans_from_rates and st.backlog_tokens() and not any(r > 0 for r in self.speeds.rates.values()):
            # Trainable work waits but no replica has reported a micro-batch yet: a policy that
            # plans from training rates (elastic) would rest on a made-up one. The first report
            # comes within one micro-batch; from then on every cell plans with the measured rate.
            return []
        changes = self.fleet.decide(self.cluster_state(st))
        leaving = [ch for ch in changes if Role(ch.to) is Role.TRAIN]
        engines_after = [c.id for c in self.cells if c.role is Role.ROLLOUT and c.id not in {ch.cell for ch in leaving}]
        if leaving and not engines_after and (st.unfinished or self.router.unfinished()):
            # The last engine stays while any run may still call the model.
            changes = [ch for ch in changes if Role(ch.to) is not Role.TRAIN]
        return self.apply(st, changes) if changes else []

    def apply(self, st: StepState, changes: list[RoleChange]) -> list[FlipRecord]:
        """Flip ``changes`` while everything else keeps working.

        A released engine (ROLLOUT -> TRAIN) stops admitting, its in-flight sequences move
        with their KV cache to the engines that stay (which keep decoding throughout: they
        take no part in the flip), its serve loop pauses, and it joins the running step's
        train_comm; the replicas finish the micro-batch in hand first (the Flip queues behind
        it) and then take micro-batches alongside it. A reclaimed replica (TRAIN -> ROLLOUT)
        hands in what it holds first: its gradients leave with it and the others redo them.
        """
        t0 = time.perf_counter()
        for ch in changes:
            print(f"[rl] step {st.step}: cell {ch.cell} -> {Role(ch.to).value}: {ch.reason}", flush=True)
        releasing = [ch.cell for ch in changes if Role(ch.to) is Role.TRAIN]
        reclaiming = [ch.cell for ch in changes if Role(ch.to) is Role.ROLLOUT]
        if reclaiming:
            self._poll_train(st, block=True)
        for cid in releasing:
            if cid in self.router.engines:
                mig = self.router.drain(cid)
                self.result.migrations += len(mig.moved)
                moved = len(mig.moved) + len(mig.moved_sessions)
                nbytes = mig.bytes + mig.session_bytes
                st.migrations.append((cid, moved, nbytes, mig.seconds))
                if not (mig.moved or mig.gone or mig.moved_sessions):
                    continue        # the engine held nothing: no migration to log
                # One row per drain: requests = in-flight sequences + retained session contexts
                # moved, tokens = their KV tokens (the detail says which is which).
                self.metrics.append([TimelineRow(
                    time=time.time(), cell=cid, role=Role.ROLLOUT.value, event="migrate", step=st.step,
                    duration_s=mig.seconds, bytes=nbytes, requests=moved, tokens=mig.kv_tokens + mig.session_kv_tokens,
                    sessions=len(mig.moved_sessions), session_tokens=mig.session_kv_tokens,
                    detail=f"{len(mig.moved)} in-flight requests ({mig.kv_tokens} KV tokens) and "
                           f"{len(mig.moved_sessions)} retained session contexts ({mig.session_kv_tokens} KV tokens) "
                           f"moved to engines {sorted(set(mig.moved.values()) | set(mig.moved_sessions.values()))}; "
                           f"{len(mig.gone)} requests finished first")])
        self.pause_engines([cid for cid in releasing if cid in self.serving])
        before = {c.id: c.role for c in self.cells}
        bystanders = frozenset(r for cid in self.serving for r in self.cell(cid).ranks)
        records = self.fleet.flip(st.step, len(st.flips), changes, bystanders=bystanders)
        for c in self.cells:
            if before[c.id] is Role.TRAIN and c.role is not Role.TRAIN:
                for r in c.ranks:   # its gradients were dropped in the flip: the others redo its share
                    st.pending[:0] = st.done_by.pop(r, [])
                    for mb in st.outstanding.pop(r, []):
                        st.pending.insert(0, mb)
        self.resume_engines()
        for c in self.cells:
            if before[c.id] is not Role.ROLLOUT and c.role is Role.ROLLOUT:
                self.router.add_engine(c.id)
        took = time.perf_counter() - t0
        for r in records:
            self.switch_s[Role(r.to)] = took
        st.flips.extend(records)
        return records

    # ---- the step ------------------------------------------------------------------------
    def _start_runs(self, step: int, active: bool) -> tuple[StepState, list[asyncio.Task]]:
        st = StepState(step, self.sample_runs(step), start_version=self.policy_version, active=active)
        stored = self.stored_trees(step)
        tasks = []
        for spec in st.specs:
            if spec.run_id in stored:
                index, tree = stored[spec.run_id]
                self._run_done(st, RunOutcome(spec, tree, from_store=True, store_index=index))
            else:
                tasks.append(asyncio.create_task(self._agent(spec, st)))
        return st, tasks

    def _may_roll_ahead(self, st: StepState) -> bool:
        """Async (continuous admission, ``sched.staleness.may_launch_batch``, the simulator's
        rule): once every run of this step has started, the next step launches if its data will
        be at most ``max_staleness`` versions old when trained. Its runs take the places this
        step's runs free, so engines keep generating through this step's tail and training."""
        gate = staleness_bound(self.fleet.policy)
        all_started = all(s.run_id in st.run_started or s.run_id in st.outcomes for s in st.specs)
        return (self._next is None and st.step < self.cfg.train.steps
                and may_launch_batch(st.step, self.policy_version, gate, all_started))

    async def run_step_async(self, step: int) -> RLStepRecord | None:
        t0 = time.perf_counter()
        if self._next is not None and self._next[0].step == step:
            (st, tasks), self._next = self._next, None
            st.active = True
            for outs in st.held:
                self._commit_group(st, outs)
            st.held = []
        else:
            st, tasks = self._start_runs(step, active=True)
        interval = self.cfg.scheduler.interval_s
        next_consult = 0.0
        exit_at_step = False
        while not (st.runs_done and not st.pending and not any(st.outstanding.values())):
            if st.groups_changed:
                st.groups_changed = False
                next_consult = 0.0     # a group became trainable: the backlog changed
            for t in tasks + (self._next[1] if self._next else []):
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()
            if self._may_roll_ahead(st):
                self._next = self._start_runs(step + 1, active=False)
            events = self._pump()
            self._poll_train(st)
            now = time.monotonic()
            # The policy is asked AFTER dispatch: a call routed in this pass is in flight, not
            # queued demand (asking before made every new call look like a reason to reclaim).
            # New calls also trigger a consultation (a batch starting may need engines back),
            # and with no engine open they stay queued: that is real demand.
            arrived = bool(self.driver.queue)
            if self.router.engines:
                events += self.driver.dispatch()
            if now >= next_consult or arrived:
                self.consult(st)
                next_consult = now + interval
            self._deal(st)
            if self.fleet.exit_requested():
                exit_at_step = True
                break
            await asyncio.sleep(0 if events else 0.002)
        if exit_at_step:
            ahead = self._next[1] if self._next else []
            self._next = None
            for t in tasks + ahead:
                t.cancel()
            await asyncio.gather(*tasks, *ahead, return_exceptions=True)
            self._poll_train(st, block=True)
            return None
        await asyncio.gather(*tasks)
        # At the step's end the policy sees an empty rollout side and a backlog of 0: e.g.
        # colocate sends its cells back to rollout before the next batch.
        return self._finish(st, t0)

    def _pump(self) -> int:
        now = time.monotonic()
        dt, self._last_pump = now - self._last_pump, now
        for e in self.router.engines:
            self._inflight_integral[e] = self._inflight_integral.get(e, 0.0) + dt * len(self.router.inflight(e))
        return self.driver.pump()

    def _finish(self, st: StepState, t0: float) -> RLStepRecord:
        outs = [st.outcomes[s.run_id] for s in st.specs]
        # Staleness: every sampled token must come from weights at most max_staleness
        # versions behind the ones this update starts from (0 for on-policy schedules; 1 for
        # async, whose runs rolled out while the previous step trained; checked, not assumed).
        gate = staleness_bound(self.fleet.policy)
        stale = [o.spec.run_id for o in outs if o.tree.n_paths and self.policy_version - o.tree.policy_version > gate]
        if stale:
            raise RuntimeError(f"step {st.step}: runs {stale[:5]} were sampled more than "
                               f"scheduler.max_staleness={gate} versions behind version {self.policy_version}")
        # The divisor of the summed gradient: runs with a target (train.averaging run) or the
        # step's targets (global); Finish carries it in n_runs.
        n_runs = step_denominator([run_targets(o.tree, self.cfg.train.shared_targets) for o in outs],
                                  self.cfg.train.averaging)
        ranks = train_ranks(self.cells)
        checksums = None
        optimizer_s = sync_s = 0.0
        sync_bytes = 0
        if n_runs:
            t_opt = time.perf_counter()
            version = self.policy_version + 1
            self.fleet.broadcast(messages.Finish(st.step, n_runs, version, self.fleet.verify_weights), ranks)
            reps = self.fleet.collect(ranks)
            bad = [r for r, rep in reps.items() if int(round(rep.replicas)) != len(ranks)]
            if bad:
                raise RuntimeError(f"step {st.step}: ranks {bad} reduced over a train_comm that is not the "
                                   f"{len(ranks)} TRAIN ranks {ranks}")
            t_sync = time.perf_counter()
            optimizer_s = t_sync - t_opt
            sync_bytes = self.push_weights(st.step, version)
            sync_s = time.perf_counter() - t_sync
            self.fleet.policy_version = version
            if self.fleet.verify_weights:
                checksums = {r: rep.checksum for r, rep in reps.items()}
        # The store index past this step's own trees, not the store's length: a relaunch that
        # redoes several steps finds the later steps' committed trees still ahead of it (a kill
        # between checkpoints, train.checkpoint_every > 1) and reuses them instead of rolling
        # those runs out again and committing them twice.
        self.trained_upto = max(self.trained_upto, st.store_end)
        recomputed = self.transport.recomputed_prefill_tokens
        recomputed, self._recomputed_mark = recomputed - self._recomputed_mark, recomputed
        rewards = [o.tree.reward for o in outs]
        loss = sum(st.losses.values()) / n_runs if n_runs else float("nan")
        gap = functools.reduce(LogprobGap.merge, st.gaps.values(), LogprobGap())
        rec = RLStepRecord(step=st.step, wall_s=time.perf_counter() - t0, loss=loss, reward_mean=float(np.mean(rewards)),
                           tokens=sum(mb.loss_tokens for v in st.done_by.values() for mb in v),
                           policy_version=self.policy_version,
                           train_cells=tuple(c.id for c in self.cells if c.role is Role.TRAIN), runs=len(outs),
                           migrations=sum(o.migrations for o in outs), restarts=sum(o.restarts for o in outs),
                           flips=len(st.flips), optimizer_s=optimizer_s, weight_sync_s=sync_s,
                           weight_sync_bytes=sync_bytes,
                           checksums=checksums, recomputed_prefill_tokens=recomputed, gap=gap)
        now = time.time()
        self._step_rows += [RunRow(time=now, step=st.step, run_id=o.spec.run_id, task_id=o.spec.task.task_id,
                                  status=o.tree.status, reward=o.tree.reward, wall_s=o.tree.wall_s,
                                  calls=o.tree.n_paths + len(o.tree.dropped_calls), migrations=o.migrations,
                                  restarts=o.restarts, policy_version=o.tree.policy_version, model_s=o.model_s,
                                  started=st.run_started.get(o.spec.run_id, 0.0))
                           for o in outs]
        self._step_rows.append(StepRow(step=st.step, time=now, wall_s=rec.wall_s, tokens=rec.tokens,
                                       replicas=len(ranks), loss=rec.loss, reward_mean=rec.reward_mean,
                                       policy_version=self.policy_version, recomputed_prefill_tokens=recomputed,
                                       logprob_gap_max=gap.max_abs if gap.targets else float("nan"),
                                       logprob_gap_mean=gap.mean_abs, pre_update_clip_share=gap.clip_share,
                                       behaviour_kl=gap.kl))
        return rec

    def push_weights(self, step: int, version: int) -> int:
        """The core leader broadcasts the new weights into every serving engine (one chunked
        broadcast, in place, not through this rank); returns the bytes each received."""
        engines = sorted(e for e in self.router.engines if e in self.serving)
        if not engines:
            return 0
        members = (core_cell(self.cells).leader,) + tuple(self.cell(e).leader for e in engines)
        core = members[0]
        t0 = time.perf_counter()
        self.fleet.send(core, messages.PushWeights(step, version, members))
        got = self.transport.call_many({e: ("recv_weights", (version, members)) for e in engines})
        self.fleet.collect([core])
        self._weights_push_s = time.perf_counter() - t0
        return int(next(iter(got.values()))["bytes"])

    # ---- the fleet's hooks ---------------------------------------------------------------
    def begin(self) -> None:
        # Tools and checkers wait in worker threads (subprocesses, sleeps): one per run, so a
        # run never queues behind another's tool call (the default pool has cores + 4).
        runs = self.cfg.rollout.tasks_per_step * self.cfg.rollout.runs_per_task
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=2 * runs + 4))
        self._pool = asyncio.Semaphore(runs)
        self.resume_engines()
        if self.plans_from_rates:
            # Measure this fleet's weight broadcast once (the weights the engines already hold,
            # same version): the policy's switch-cost prior until its first flip is measured.
            self.push_weights(self.fleet.start_step, self.policy_version)

    def run_step(self, step: int) -> RLStepRecord | None:
        rec = self._loop.run_until_complete(self.run_step_async(step))
        if rec is not None:
            print(f"[rl] step {step}/{self.cfg.train.steps} reward {rec.reward_mean:.3f} loss {rec.loss:.4f} "
                  f"train cells {list(rec.train_cells)} flips {rec.flips} requests moved mid-decode {rec.migrations} "
                  f"logprob gap max {rec.gap.max_abs:.3g} {rec.wall_s:.2f}s", flush=True)
        return rec

    def checkpoint_contents(self, step: int, staging: Path) -> tuple[list[str], dict]:
        rows = [r for r in self._step_rows if r.step <= step]
        (staging / STEP_ROWS_FILE).write_text(json.dumps([[type(r).__name__, dataclasses.asdict(r)] for r in rows]))
        return (list(OPTIMIZER_FILES) + [STEP_ROWS_FILE],
                {"trees_committed": len(self.store), "trained_upto": self.trained_upto, "workload": "rl"})

    def sealed(self, step: int) -> None:
        # A step's rows are written once a checkpoint covering it is committed, so a fleet
        # killed before that (between checkpoints with train.checkpoint_every > 1, or between
        # a step's end and its commit) redoes the step without a second row for it. The
        # checkpoint carries the rows it seals; a relaunch writes them if the kill came right
        # after the commit (restore_step_rows).
        rows = [r for r in self._step_rows if r.step <= step]
        self._step_rows = [r for r in self._step_rows if r.step > step]
        self.metrics.append(rows)

    def step_done(self, step: int, checkpointed: bool) -> None:
        pass

    def before_stop(self) -> None:
        if self._next is not None:      # runs rolled out ahead of a step that will not run now
            ahead, self._next = self._next[1], None
            for t in ahead:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*ahead, return_exceptions=True))
        self.pause_engines()
        # Prompt tokens prefilled more than once across engines (computed, or served from a
        # retained context): 0 unless a migrated sequence was recomputed instead of continued
        # from its KV cache.
        cached = sum(c.cached_prompt_tokens for c in self.engine_counters.values())
        prefilled = sum(c.prefill_tokens for c in self.engine_counters.values()) + cached
        self.result.recomputed_prefill_tokens = prefilled - self.driver.prompt_tokens
        self.result.cached_prompt_tokens = cached
        print(f"[rl] prompt tokens {self.driver.prompt_tokens}: {cached} served from retained session contexts "
              f"({cached / max(self.driver.prompt_tokens, 1):.0%}), {prefilled - cached} prefilled, "
              f"{self.result.recomputed_prefill_tokens} recomputed", flush=True)
        if self._loop is not None:
            self._loop.close()
            self._loop = None

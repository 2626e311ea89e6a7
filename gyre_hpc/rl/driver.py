"""The RL workload's step driver on rank 0: one step's loop, read top to bottom.

Everything that touches MPI on this rank runs on one asyncio loop on one thread, through the
one fleet controller (``cells.controller.Controller``), so a silent replica fails the fleet
within the reply timeout, naming the rank and the command it owed. A step:

1. start its runs (``rollouts``): ``rollout.tasks_per_step`` tasks x ``rollout.runs_per_task``
   runs, each an agent task whose model calls go through ``RoutedCalls`` to the ROLLOUT
   engines (``engine_pool``); tools and checkers run in worker threads;
2. pump: engine token streams, the queued calls dispatched, replicas' reports taken;
3. as an advantage group finishes, commit its trees to ``trees.zarr`` and deal its
   micro-batches to the TRAIN replicas (``train_queue``) while other runs still roll out; a
   step rolling out ahead stores its finished groups once this step's trees are all stored,
   and deals them when it becomes the current step;
4. every ``scheduler.interval_s`` (and when new calls arrive) the policy sees the live view
   (``cluster_view``) and may flip cells (``flips``: KV moves with released engines); the
   flip completes while the loop goes on, since replicas answer it after their micro-batch
   in hand;
5. async schedules start the next step's runs once this one's have all started, within
   ``scheduler.max_staleness``;
6. once every run is done and every micro-batch trained: allreduce, optimizer step
   (version + 1), the new weights into every engine, the step's record; its rows wait for
   the checkpoint that seals them (``step_rows``).

Exactly-once trees across a kill: the checkpoint records how many committed trees the model
has trained on (``trained_upto``). A relaunch trains the steps after the checkpoint; trees of
those steps already in the store (committed before the kill) are read back instead of being
rolled out again, and runs not in the store resume from their journals.
"""
from __future__ import annotations

import asyncio
import functools
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gyre_hpc.cells.controller import Controller
from gyre_hpc.cells.plan import train_ranks
from gyre_hpc.rl.cluster_view import ClusterView
from gyre_hpc.rl.engine_pool import EnginePool
from gyre_hpc.rl.flips import Flips
from gyre_hpc.rl.rollouts import Rollouts
from gyre_hpc.rl.router_client import RoutedCalls
from gyre_hpc.cells.step_rows import UnsealedRows
from gyre_hpc.models.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from gyre_hpc.rl.step_rows import pace_events, step_rows
from gyre_hpc.rl.step_state import RLStepRecord, StepState, stale_runs
from gyre_hpc.rl.train_queue import TrainQueue
from gyre_hpc.rl.trainer import OPTIMIZER_FILE
from gyre_hpc.sched.staleness import may_launch_batch, staleness_bound
from gyre_hpc.sched.state import Role
from gyre_hpc.trees.loss import LogprobGap, run_targets, step_denominator
from gyre_hpc.trees.store import TreeStore

# What an RL checkpoint directory must hold before it is sealed: an HF folder (weights, config)
# and the optimizer's state, named where they are written.
CHECKPOINT_FILES = (WEIGHTS_FILE, CONFIG_FILE, OPTIMIZER_FILE)
# How long a new context (a run's first call) waits for an engine coming back before it is
# routed to the open ones (``RoutedCalls.dispatch``): a return flip at an update takes ~0.2 s
# on paper-local; one that waits on a replica's micro-batch in hand takes seconds, too long
# to keep a run waiting.
HOLD_NEW_S = 1.0

Ahead = tuple[StepState, list[asyncio.Task]]


class RLStepDriver:
    def __init__(self, fleet: Controller, engine_comm, store: TreeStore, trained_upto: int, max_batch: int = 64):
        self.fleet, self.cfg, self.store, self.trained_upto = fleet, fleet.cfg, store, trained_upto
        self.engines = EnginePool(fleet, engine_comm)
        self.calls = RoutedCalls(self.engines.router, temperature=self.cfg.rollout.temperature,
                                 top_p=self.cfg.rollout.top_p)
        self.train = TrainQueue(fleet, store)
        self.rollouts = Rollouts(fleet, store, self.calls, on_group=self.train.commit_group)
        self.view = ClusterView(fleet, self.engines, self.calls, self.train, max_batch)
        self.flips = Flips(fleet, self.engines, self.train, self.view)
        self.rows = UnsealedRows()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next: Ahead | None = None   # the next step, rolling out ahead (async)

    # ---- the step ------------------------------------------------------------------------
    async def run_step_async(self, step: int) -> RLStepRecord | None:
        t0 = time.perf_counter()
        st, tasks = self._take_or_start(step)
        next_consult = 0.0
        while not st.trained or self.flips.pending:
            if st.groups_changed:
                st.groups_changed = False
                next_consult = 0.0     # a group became trainable: the backlog changed
            self._raise_failed(tasks)
            if self._may_roll_ahead(st):
                self._next = self.rollouts.start(step + 1, active=False, trained_upto=self.trained_upto)
            if self._next is not None:
                self.train.store_ahead(st, self._next[0])
            self.view.tick()
            events = self.calls.pump()
            self.train.poll(st)
            # The policy is asked AFTER dispatch: a call routed in this pass is in flight, not
            # queued demand (asking before made every new call look like a reason to reclaim).
            # New calls also trigger a consultation (a batch starting may need engines back),
            # and with no engine open they stay queued: that is real demand.
            arrived = bool(self.calls.queue)
            if self.engines.router.engines:
                events += self.calls.dispatch(hold_new=self.flips.engines_arriving(time.perf_counter(), HOLD_NEW_S))
            now = time.monotonic()
            if self.flips.pending:
                # A flip in flight waits on the replicas' micro-batches in hand; the runs go on.
                events += len(self.flips.finish(st))
            elif now >= next_consult or arrived:
                self.flips.consult(st, self._next[0] if self._next else None)
                next_consult = now + self.cfg.scheduler.interval_s
            if not self.flips.pending:
                self.train.deal(st)
            if self.fleet.exit_requested():
                await self._abandon(st, tasks)
                return None
            await asyncio.sleep(0 if events else 0.002)
        await asyncio.gather(*tasks)
        return self._finish(st, t0)

    def _take_or_start(self, step: int) -> Ahead:
        if self._next is not None and self._next[0].step == step:
            (st, tasks), self._next = self._next, None
            self.rollouts.activate(st)
            return st, tasks
        return self.rollouts.start(step, active=True, trained_upto=self.trained_upto)

    def _raise_failed(self, tasks: list[asyncio.Task]) -> None:
        for t in tasks + (self._next[1] if self._next else []):
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()

    def _may_roll_ahead(self, st: StepState) -> bool:
        """Async (continuous admission, ``sched.staleness.may_launch_batch``, the simulator's
        rule): once every run of this step has started, the next step launches if its data will
        be at most ``max_staleness`` versions old when trained. Its runs take the places this
        step's runs free, so engines keep generating through this step's tail and training."""
        gate = staleness_bound(self.fleet.policy)
        return (self._next is None and st.step < self.cfg.train.steps
                and may_launch_batch(st.step, self.fleet.policy_version, gate, st.all_started))

    async def _abandon(self, st: StepState, tasks: list[asyncio.Task]) -> None:
        """An exit request: cancel the runs (their journals resume them), end a flip in flight,
        let replicas report."""
        while self.flips.pending:
            self.flips.finish(st)
            await asyncio.sleep(0.002)
        ahead = self._next[1] if self._next else []
        self._next = None
        for t in tasks + ahead:
            t.cancel()
        await asyncio.gather(*tasks, *ahead, return_exceptions=True)
        self.train.poll(st, block=True)

    def _finish(self, st: StepState, t0: float) -> RLStepRecord:
        outs = st.outcomes_in_order()
        gate = staleness_bound(self.fleet.policy)
        stale = stale_runs(outs, self.fleet.policy_version, gate)
        if stale:
            raise RuntimeError(f"step {st.step}: runs {stale[:5]} were sampled more than "
                               f"scheduler.max_staleness={gate} versions behind version {self.fleet.policy_version}")
        # The divisor of the summed gradient: runs with a target (train.averaging run) or the
        # step's targets (global); Finish carries it in n_runs.
        n_runs = step_denominator([run_targets(o.tree, self.cfg.train.shared_targets) for o in outs],
                                  self.cfg.train.averaging)
        ranks = train_ranks(self.fleet.cells)
        checksums, weights_checksums, optimizer_s, sync_s, sync_bytes = None, None, 0.0, 0.0, 0
        if n_runs:
            t_opt = time.perf_counter()
            version = self.fleet.policy_version + 1
            training = frozenset(c.id for c in self.fleet.cells if c.role is Role.TRAIN)
            reps = self.train.optimizer_step(st.step, n_runs, version, ranks,
                                             weights_from_core=bool(self.flips.weights_only))
            t_sync = time.perf_counter()
            optimizer_s = t_sync - t_opt
            sync_bytes = self.engines.push_weights(st.step, version)
            sync_s = time.perf_counter() - t_sync
            self.flips.updated(training, self.engines.pushed)
            self.fleet.policy_version = version
            if self.fleet.verify_weights:
                checksums = {r: rep.checksum for r, rep in reps.items() if rep.checksum is not None}
                weights_checksums = {r: rep.weights_checksum for r, rep in reps.items()}
        # The store index past this step's own trees, not the store's length: a relaunch that
        # redoes several steps finds the later steps' committed trees still ahead of it (a kill
        # between checkpoints, train.checkpoint_every > 1) and reuses them instead of rolling
        # those runs out again and committing them twice.
        self.trained_upto = max(self.trained_upto, st.store_end)
        rec = RLStepRecord(
            step=st.step, wall_s=time.perf_counter() - t0,
            loss=sum(st.losses.values()) / n_runs if n_runs else float("nan"),
            reward_mean=float(np.mean([o.tree.reward for o in outs])), tokens=self.train.trained_tokens(st),
            policy_version=self.fleet.policy_version,
            train_cells=tuple(c.id for c in self.fleet.cells if c.role is Role.TRAIN), runs=len(outs),
            migrations=sum(o.migrations for o in outs), restarts=sum(o.restarts for o in outs),
            flips=len(st.flips), optimizer_s=optimizer_s, weight_sync_s=sync_s, weight_sync_bytes=sync_bytes,
            checksums=checksums, weights_checksums=weights_checksums, recomputed_prefill_tokens=self.engines.recomputed_since_last(),
            gap=functools.reduce(LogprobGap.merge, st.gaps.values(), LogprobGap()))
        now = time.time()
        if self.cfg.cells.device == "paced":
            self.fleet.metrics.append(pace_events(st.step, self.engines.pace_records(), st.replica_pace,
                                                  self.fleet.cells, now))
        self.rows.add(step_rows(st, rec, len(ranks), now))
        return rec

    # ---- the fleet's hooks ---------------------------------------------------------------
    def begin(self) -> None:
        # Tools and checkers wait in worker threads (subprocesses, sleeps): one per run, so a
        # run never queues behind another's tool call (the default pool has cores + 4).
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(ThreadPoolExecutor(max_workers=2 * self.rollouts.places + 4))
        self.engines.resume()
        if self.view.plans_from_rates:
            # Measure this fleet's weight broadcast once (the weights the engines already hold,
            # same version): the policy's switch-cost prior until its first flip is measured.
            self.engines.push_weights(self.fleet.start_step, self.fleet.policy_version)

    def run_step(self, step: int) -> RLStepRecord | None:
        rec = self._loop.run_until_complete(self.run_step_async(step))
        if rec is not None:
            print(f"[rl] step {step}/{self.cfg.train.steps} reward {rec.reward_mean:.3f} loss {rec.loss:.4f} "
                  f"train cells {list(rec.train_cells)} flips {rec.flips} requests moved mid-decode {rec.migrations} "
                  f"logprob gap max {rec.gap.max_abs:.3g} {rec.wall_s:.2f}s", flush=True)
        return rec

    def checkpoint_contents(self, step: int, staging: Path) -> tuple[list[str], dict]:
        return (list(CHECKPOINT_FILES) + [self.rows.save(staging, step)],
                {"trees_committed": len(self.store), "trained_upto": self.trained_upto})

    def sealed(self, step: int) -> None:
        self.rows.seal(step, self.fleet.metrics)

    def before_stop(self) -> None:
        if self._next is not None:      # runs rolled out ahead of a step that will not run now
            ahead, self._next = self._next[1], None
            for t in ahead:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*ahead, return_exceptions=True))
        if self._loop is not None:
            self._loop.run_until_complete(self.rollouts.stop())
        self.engines.pause()
        asked = self.calls.prompt_tokens
        totals = self.fleet.result.totals
        totals.setdefault("migrations", 0)      # in-flight requests moved with their KV cache
        totals.update(self.engines.prompt_totals(asked))
        # Peak resident memory of this rank (controller, router, harness runs, store writer) and
        # of the largest training replica, over the launch (bench xlong reads them).
        totals.update(controller_peak_rss_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      train_peak_rss_kib=self.train.peak_rss_kib)
        cached, recomputed = totals["cached_prompt_tokens"], totals["recomputed_prefill_tokens"]
        print(f"[rl] prompt tokens {asked}: {cached} served from retained session contexts "
              f"({cached / max(asked, 1):.0%}), {asked - cached + recomputed} prefilled, {recomputed} recomputed",
              flush=True)
        if self._loop is not None:
            self._loop.close()
            self._loop = None

"""Role changes while the step runs: the policy consulted on the live view, and its changes
applied without stopping the rest of the fleet.

A released engine (ROLLOUT -> TRAIN) stops admitting, its in-flight sequences and retained
agent contexts move with their KV cache to the engines that stay (which keep decoding
throughout: they take no part in the flip), its serve loop pauses, and it joins the running
step's train_comm; the replicas finish the micro-batch in hand first (the Flip queues behind
it) and then take micro-batches alongside it. A reclaimed replica (TRAIN -> ROLLOUT) hands in
what it holds first: its gradients leave with it and the others redo them.

A released cell that applied the step's last update with the replicas (it trained at the
end of the previous step, which an elastic fleet's cells all do; in a launch's first step,
every cell, from the start-up broadcast) already holds the core's weights and optimizer
moments: it joins in place (``Controller.flip_begin``), alone, and takes micro-batches at
once; the replicas learn of it when they meet for the step's allreduce. A cell that served
while an update was applied without it holds that update's weights (every serving engine is
sent them right after it) but not the moments: it joins in place all the same, weights only.
Its gradients are the step's like any replica's, since they need the weights and nothing
else; at the update it adds them to the allreduce and, instead of applying the update with
moments it does not hold, takes the new weights from the core (``messages.Finish``). Only a
cell that holds neither waits for the replicas' micro-batches in hand and receives the whole
state.

The flip is sent and then left to complete (``start``, then ``finish`` once every rank in it
has answered): waiting for a replica's micro-batch in hand (seconds when paced) must not stop
the controller from serving the runs, so the step's loop keeps routing calls, streaming tokens
and running tools meanwhile. No other flip is decided and no micro-batch dealt until it ends.
"""
from __future__ import annotations

import time

from gyre_hpc.cells.controller import Controller, FlipRecord, PendingFlip
from gyre_hpc.rl.cluster_view import ClusterView
from gyre_hpc.rl.engine_pool import EnginePool
from gyre_hpc.rl.step_state import StepState
from gyre_hpc.rl.train_queue import TrainQueue
from gyre_hpc.rundir.metrics import TimelineRow
from gyre_hpc.sched.state import Role, RoleChange


class Flips:
    def __init__(self, fleet: Controller, pool: EnginePool, queue: TrainQueue, view: ClusterView):
        self.fleet, self.pool, self.queue, self.view = fleet, pool, queue, view
        self.pending: tuple[PendingFlip, dict[int, Role], float] | None = None   # (flip, roles before, t0)
        # Cells whose ranks hold the core's whole state. At a launch, every cell: the fleet's
        # start-up broadcast (``cells.fleet``) gave each the core's weights and moments, fresh or
        # from the checkpoint. Then the cells that applied the last update together (``updated``).
        self.current: frozenset[int] = frozenset(c.id for c in fleet.cells)
        # Cells whose ranks hold the current version's weights: those in ``current``, the
        # weights-only replicas, and the engines the last update was pushed to.
        self.has_weights: frozenset[int] = self.current

    def engines_arriving(self, now: float, hold_s: float) -> bool:
        """A flip to ROLLOUT in flight for less than ``hold_s`` (``time.perf_counter``): the
        engines it brings back are worth waiting for before routing a new context. Past
        ``hold_s`` (a replica finishing its micro-batch in hand first), the open ones take it."""
        if self.pending is None:
            return False
        flip, _, t0 = self.pending
        return now - t0 < hold_s and any(Role(ch.to) is Role.ROLLOUT for ch in flip.changes)

    @property
    def weights_only(self) -> frozenset[int]:
        """TRAIN cells without the moments (they joined weights only): they take the core's
        weights at each update."""
        return frozenset(c.id for c in self.fleet.cells if c.role is Role.TRAIN) - self.current

    def updated(self, train_cells: frozenset[int], pushed: frozenset[int]) -> None:
        """An optimizer step was applied by ``train_cells`` (the weights-only ones took its
        weights from the core) and its weights sent to the engines ``pushed``."""
        self.current = train_cells & self.current
        self.has_weights = train_cells | pushed

    def consult(self, st: StepState, ahead: StepState | None = None) -> None:
        """Ask the policy on the live view (``ahead``: the next step rolling out ahead, async)
        and start the flip it decides."""
        if self.pending is not None:
            return          # one flip at a time: the policy sees the fleet once this one has ended
        if self.view.plans_from_rates and st.backlog_tokens() and not any(r > 0 for r in self.queue.speeds.rates.values()):
            # Trainable work waits but no replica has reported a micro-batch yet: a policy that
            # plans from training rates (elastic) would rest on a made-up one. The first report
            # comes within one micro-batch; from then on every cell plans with the measured rate.
            return
        changes = self.fleet.decide(self.view.state(st, ahead, self.has_weights, self.current))
        leaving = [ch for ch in changes if Role(ch.to) is Role.TRAIN]
        engines_after = [c.id for c in self.fleet.cells
                         if c.role is Role.ROLLOUT and c.id not in {ch.cell for ch in leaving}]
        if leaving and not engines_after and (st.unfinished or (ahead is not None and ahead.unfinished)
                                              or self.pool.router.unfinished()):
            # The last engine stays while any run may still call the model.
            changes = [ch for ch in changes if Role(ch.to) is not Role.TRAIN]
        if changes:
            self.start(st, changes)

    def start(self, st: StepState, changes: list[RoleChange]) -> None:
        """Drain and pause the released engines, send the flip; the rest of the fleet works on
        (the module's docstring)."""
        t0 = time.perf_counter()
        for ch in changes:
            print(f"[rl] step {st.step}: cell {ch.cell} -> {Role(ch.to).value}: {ch.reason}", flush=True)
        releasing = [ch.cell for ch in changes if Role(ch.to) is Role.TRAIN]
        for cid in releasing:
            if cid in self.pool.router.engines:
                self._drain(st, cid)
        self.pool.pause([cid for cid in releasing if cid in self.pool.serving])
        before = {c.id: c.role for c in self.fleet.cells}
        bystanders = frozenset(r for cid in self.pool.serving for r in self.fleet.cell(cid).ranks)
        in_place = all(Role(ch.to) is Role.TRAIN and ch.cell in self.has_weights for ch in changes)
        weights_only = frozenset(ch.cell for ch in changes if ch.cell not in self.current) if in_place else frozenset()
        self.pending = (self.fleet.flip_begin(st.step, len(st.flips), changes, bystanders=bystanders,
                                              in_place=in_place, weights_only=weights_only), before, t0)

    def finish(self, st: StepState) -> list[FlipRecord]:
        """End the flip in flight if every rank has answered: a leaver's share back to the
        queue (its reports, which came before its answer, taken first), engines opened."""
        if self.pending is None or not self.fleet.flip_ready(self.pending[0]):
            return []
        pending, before, t0 = self.pending
        self.pending = None
        records = self.fleet.flip_end(pending)
        self.queue.poll(st)
        self.queue.hand_back(st, [c for c in self.fleet.cells
                                  if before[c.id] is Role.TRAIN and c.role is not Role.TRAIN])
        self.pool.resume()
        for c in self.fleet.cells:
            if before[c.id] is not Role.ROLLOUT and c.role is Role.ROLLOUT:
                self.pool.router.add_engine(c.id)
        took = time.perf_counter() - t0
        # A joiner that received the core's state holds it now, as one in place does; a
        # weights-only joiner holds the weights alone until it leaves TRAIN.
        joined = frozenset(r.cell for r in records if Role(r.to) is Role.TRAIN)
        self.current |= joined - frozenset(r.cell for r in records if r.weights_only)
        self.has_weights |= joined
        for r in records:
            kind = "rollout" if Role(r.to) is Role.ROLLOUT else "in_place" if pending.in_place else "moved"
            self.view.switch_s[kind] = took
        st.flips.extend(records)
        return records

    def _drain(self, st: StepState, cid: int) -> None:
        """Move a released engine's sequences and contexts, with their KV, to the others."""
        mig = self.pool.router.drain(cid)
        totals = self.fleet.result.totals
        totals["migrations"] = totals.get("migrations", 0) + len(mig.moved)
        moved = len(mig.moved) + len(mig.moved_sessions)
        nbytes = mig.bytes + mig.session_bytes
        st.migrations.append((cid, moved, nbytes, mig.seconds))
        if not (mig.moved or mig.gone or mig.moved_sessions):
            return        # the engine held nothing: no migration to log
        # One row per drain: requests = in-flight sequences + retained session contexts
        # moved, tokens = their KV tokens (the detail says which is which).
        self.fleet.metrics.append([TimelineRow(
            time=time.time(), cell=cid, role=Role.ROLLOUT.value, event="migrate", step=st.step,
            duration_s=mig.seconds, bytes=nbytes, requests=moved, tokens=mig.kv_tokens + mig.session_kv_tokens,
            sessions=len(mig.moved_sessions), session_tokens=mig.session_kv_tokens,
            detail=f"{len(mig.moved)} in-flight requests ({mig.kv_tokens} KV tokens) and "
                   f"{len(mig.moved_sessions)} retained session contexts ({mig.session_kv_tokens} KV tokens) "
                   f"moved to engines {sorted(set(mig.moved.values()) | set(mig.moved_sessions.values()))}; "
                   f"{len(mig.gone)} requests finished first")])

"""The substrate (smoke) workload's step driver: a step cut into rounds.

Each TRAIN rank takes one micro-batch per round, so the controller regains control often:
between rounds it asks the policy again (a flip may land mid-step) and looks for
``control/checkpoint-and-exit``. A cell that leaves TRAIN mid-step hands back its
micro-batches; the replicas that remain redo them, so a step's gradient is always the mean
over all its micro-batches. ROLLOUT ranks run a slice of ``SubstrateWorkload.rollout`` per round.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc.cells import checkpoint
from gyre_hpc.cells.controller import Controller, StepRecord
from gyre_hpc.cells.step_rows import UnsealedRows
from gyre_hpc.cells.plan import cell_of_rank, train_ranks
from gyre_hpc.rundir.metrics import StepRow
from gyre_hpc.sched.state import CellState, ClusterState, Role, RoleChange
from gyre_hpc.substrate import messages


@dataclass
class SubstrateDriver:
    fleet: Controller
    # Measured per cell: tokens/s as a replica and as an engine (policy inputs).
    _train_rate: dict[int, float] = field(default_factory=dict)
    _rollout_rate: dict[int, float] = field(default_factory=dict)
    _tokens_per_micro_batch: int = 0      # backlog estimate, from reports
    _last_consult: float = float("-inf")
    _rows: UnsealedRows = field(default_factory=UnsealedRows)

    # ---- policy --------------------------------------------------------------------------
    def cluster_state(self, step: int, backlog_tokens: int = 0) -> ClusterState:
        """What the policy sees: roles, measured rates and switch costs, the step's backlog."""
        fl = self.fleet
        r2t = [f.duration_s for f in fl.result.flips if f.to == Role.TRAIN.value]
        t2r = [f.duration_s for f in fl.result.flips if f.to == Role.ROLLOUT.value]
        defaults = ClusterState(time=0.0, step=0, cells=())
        return ClusterState(
            time=time.time(), step=step,
            cells=tuple(CellState(cell=c.id, kind=c.kind, role=c.role,
                                  train_tokens_per_s=self._train_rate.get(c.id, 0.0),
                                  rollout_tokens_per_s=self._rollout_rate.get(c.id, 0.0)) for c in fl.cells),
            train_backlog_tokens=backlog_tokens, policy_version=fl.policy_version,
            rollout_to_train_s=statistics.median(r2t) if r2t else defaults.rollout_to_train_s,
            train_to_rollout_s=statistics.median(t2r) if t2r else defaults.train_to_rollout_s)

    def consult(self, step: int, round_: int, backlog_tokens: int) -> list[RoleChange]:
        """Ask the policy (at a step's start always, mid-step every scheduler.interval_s) and flip."""
        now = time.monotonic()
        if round_ > 0 and now - self._last_consult < self.fleet.cfg.scheduler.interval_s:
            return []
        self._last_consult = now
        changes = self.fleet.decide(self.cluster_state(step, backlog_tokens))
        if changes:
            self.fleet.flip(step, round_, changes)
        return changes

    def _measure(self, replies: dict[int, messages.RoundReport]) -> None:
        by_cell: dict[int, list[messages.RoundReport]] = {}
        for rank, rep in replies.items():
            by_cell.setdefault(cell_of_rank(self.fleet.cells, rank).id, []).append(rep)
        for cid, reps in by_cell.items():
            seconds = max(r.seconds for r in reps)
            if seconds <= 0:
                continue
            train, rollout = sum(r.tokens for r in reps), sum(r.rollout_tokens for r in reps)
            if train:
                self._train_rate[cid] = train / seconds
            if rollout:
                self._rollout_rate[cid] = rollout / seconds

    # ---- steps ---------------------------------------------------------------------------
    def micro_batches_per_step(self) -> int:
        """Enough micro-batches for every rank that could train to take one per round."""
        plan = self.fleet.cfg.cells
        return max(2, plan.count * plan.ranks_per_cell)

    def begin(self) -> None:
        pass

    def run_step(self, step: int) -> StepRecord | None:
        fl = self.fleet
        t0 = time.perf_counter()
        total = self.micro_batches_per_step()
        self.consult(step, 0, total * self._tokens_per_micro_batch)
        fl.broadcast(messages.BeginStep(step))
        fl.collect()
        pending = list(range(total))
        done_by: dict[int, list[int]] = {}
        losses: dict[int, float] = {}
        mb_tokens: dict[int, int] = {}
        round_ = 0
        while pending:
            if round_ > 0:
                before = {c.id: c.role for c in fl.cells}
                self.consult(step, round_, len(pending) * self._tokens_per_micro_batch)
                for c in fl.cells:
                    if before[c.id] is Role.TRAIN and c.role is not Role.TRAIN:
                        for r in c.ranks:                       # hand back its micro-batches
                            for mb in done_by.pop(r, []):
                                pending.append(mb)
                                losses.pop(mb, None)
                                mb_tokens.pop(mb, None)
                    if before[c.id] is not Role.TRAIN and c.role is Role.TRAIN:
                        for r in c.ranks:
                            done_by.pop(r, None)
            if fl.exit_requested():
                fl.broadcast(messages.AbortStep(step))
                fl.collect()
                return None
            ranks = train_ranks(fl.cells)
            assign = {r: (mb,) for r, mb in zip(ranks, pending)}
            pending = pending[len(assign):]
            fl.broadcast(messages.Round(step=step, round=round_, assign=assign))
            replies = fl.collect()
            self._measure(replies)
            for rank, rep in replies.items():
                if rep.losses:
                    done_by.setdefault(rank, []).extend(rep.losses)
                    losses.update(rep.losses)
                    self._tokens_per_micro_batch = rep.tokens // len(rep.losses)
                    mb_tokens.update((mb, self._tokens_per_micro_batch) for mb in rep.losses)
            round_ += 1
        fl.broadcast(messages.EndStep(step=step, micro_batches=total, checksums=fl.verify_weights))
        ends = fl.collect()
        fl.policy_version += 1
        rec = StepRecord(step=step, wall_s=time.perf_counter() - t0, loss=sum(losses.values()) / len(losses),
                         train_cells=tuple(c.id for c in fl.cells if c.role is Role.TRAIN),
                         tokens=sum(mb_tokens.values()), policy_version=fl.policy_version,
                         checksums={r: e.checksum for r, e in ends.items()} if fl.verify_weights else None)
        self._rows.add([StepRow(step=step, time=time.time(), wall_s=rec.wall_s, tokens=rec.tokens,
                                replicas=len(rec.train_cells), loss=rec.loss, policy_version=rec.policy_version)])
        print(f"[fleet] step {step}/{fl.cfg.train.steps} loss {rec.loss:.5f} train cells {list(rec.train_cells)} "
              f"{rec.wall_s:.2f}s", flush=True)
        return rec

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint_contents(self, step: int, staging: Path) -> tuple[list[str], dict]:
        return [checkpoint.STATE_FILE, self._rows.save(staging, step)], {}

    def sealed(self, step: int) -> None:
        self._rows.seal(step, self.fleet.metrics)

    def before_stop(self) -> None:
        pass

"""Rank 0 of the fleet: drives steps, asks the policy, flips cells, checkpoints, logs.

The controller is the only writer of ``metrics.h5`` while the fleet runs; cells report
their timings to it in replies. A step is cut into rounds (each TRAIN rank takes one
micro-batch per round) so the controller regains control often: between rounds it asks the
policy again (a flip may land mid-step) and looks for ``control/checkpoint-and-exit``.
A cell that leaves TRAIN mid-step hands back its micro-batches; the replicas that remain
redo them, so a step's gradient is always the mean over all its micro-batches.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpi4py import MPI

from gyre_hpc.cells import checkpoint, protocol
from gyre_hpc.cells.plan import Cell, cell_of_rank, core_cell, train_ranks, with_roles
from gyre_hpc.config import RunConfig
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter, StepRow, TimelineRow
from gyre_hpc.sched.state import CellState, ClusterState, Policy, Role, RoleChange

EXIT_DONE = 0
EXIT_CHECKPOINTED = 75
CHECKPOINT_AND_EXIT = "checkpoint-and-exit"


@dataclass(frozen=True)
class FlipRecord:
    """One cell's role change, as logged to the timeline and returned to benchmarks/tests."""

    cell: int
    to: str
    step: int
    round: int
    start: float
    end: float
    duration_s: float      # the cell's own measure: command received to ready in the new role
    bytes: int             # weight bytes received by the cell's ranks
    comm_s: float = 0.0    # of duration_s: communicator re-derivation
    transfer_s: float = 0.0  # of duration_s: weight transfer
    checksum: str | None = None
    source_checksum: str | None = None


@dataclass(frozen=True)
class StepRecord:
    step: int
    wall_s: float
    loss: float
    train_cells: tuple[int, ...]
    tokens: int
    policy_version: int
    checksums: dict[int, str] | None = None   # world rank -> state checksum after the step


@dataclass
class FleetResult:
    exit_code: int
    first_step: int
    last_completed: int
    flips: list[FlipRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    train_comm_checks: int = 0


@dataclass
class Controller:
    world: MPI.Intracomm
    cfg: RunConfig
    run: RunDir
    cells: tuple[Cell, ...]
    policy: Policy
    metrics: MetricsWriter
    start_step: int
    policy_version: int
    verify_weights: bool = False
    keep_checkpoints: int = 2
    control_poll_s: float = 0.25
    last_checkpointed: int = -1        # the step the newest checkpoint holds (resume: meta.step)
    reply_timeout_s: float = 600.0     # a cell rank silent this long is declared stuck
    result: FleetResult = field(init=False)
    _exit_requested: bool = field(default=False, init=False)
    _last_control_check: float = field(default=0.0, init=False)
    _last_consult: float = field(default=float("-inf"), init=False)
    _unsealed_rows: list[StepRow] = field(default_factory=list, init=False)
    # Measured per cell: tokens/s as a replica and as an engine (policy inputs).
    _train_rate: dict[int, float] = field(default_factory=dict, init=False)
    _rollout_rate: dict[int, float] = field(default_factory=dict, init=False)
    _tokens_per_micro_batch: int = field(default=0, init=False)   # backlog estimate, from reports
    _last_command: str = field(default="", init=False)

    def __post_init__(self) -> None:
        self.result = FleetResult(exit_code=-1, first_step=self.start_step, last_completed=self.start_step - 1)
        self.cell_ranks = [r for c in self.cells for r in c.ranks]

    # ---- messaging -------------------------------------------------------------------
    def broadcast(self, cmd) -> None:
        self._last_command = type(cmd).__name__ + (f" (step {cmd.step})" if hasattr(cmd, "step") else "")
        for r in self.cell_ranks:
            self.world.send(cmd, dest=r, tag=protocol.TAG_COMMAND)

    def collect(self) -> dict[int, object]:
        """One reply from every cell rank, watching the control directory while waiting.

        A rank that is alive but never answers (stuck in a collective, a deadlocked workload)
        would hold the fleet forever without ever failing; past ``reply_timeout_s`` the
        controller raises, naming the silent ranks, and the fleet aborts for a relaunch.
        """
        replies: dict[int, object] = {}
        pause = 0.0002
        deadline = time.monotonic() + self.reply_timeout_s
        while len(replies) < len(self.cell_ranks):
            if time.monotonic() > deadline:
                silent = [r for r in self.cell_ranks if r not in replies]
                raise TimeoutError(f"cell ranks {silent} did not answer {self._last_command} within "
                                   f"{self.reply_timeout_s:g} s")
            status = MPI.Status()
            if self.world.Iprobe(source=MPI.ANY_SOURCE, tag=protocol.TAG_REPLY, status=status):
                msg = self.world.recv(source=status.Get_source(), tag=protocol.TAG_REPLY)
                replies[status.Get_source()] = msg
                pause = 0.0002
                continue
            self.exit_requested(now=False)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        return replies

    def exit_requested(self, now: bool = True) -> bool:
        """Has the supervisor asked for checkpoint-and-exit? Always looked up at step and round
        boundaries; while waiting for replies (``now=False``) at most every ``control_poll_s``."""
        t = time.monotonic()
        if not self._exit_requested and (now or t - self._last_control_check >= self.control_poll_s):
            self._last_control_check = t
            self._exit_requested = (self.run.control / CHECKPOINT_AND_EXIT).exists()
        return self._exit_requested

    # ---- policy and flips ------------------------------------------------------------
    def cluster_state(self, step: int, backlog_tokens: int = 0) -> ClusterState:
        """What the policy sees: roles, measured rates and switch costs, the step's backlog."""
        r2t = [f.duration_s for f in self.result.flips if f.to == Role.TRAIN.value]
        t2r = [f.duration_s for f in self.result.flips if f.to == Role.ROLLOUT.value]
        defaults = ClusterState(time=0.0, step=0, cells=())
        return ClusterState(
            time=time.time(), step=step,
            cells=tuple(CellState(cell=c.id, kind=c.kind, role=c.role,
                                  train_tokens_per_s=self._train_rate.get(c.id, 0.0),
                                  rollout_tokens_per_s=self._rollout_rate.get(c.id, 0.0)) for c in self.cells),
            train_backlog_tokens=backlog_tokens, policy_version=self.policy_version,
            rollout_to_train_s=statistics.median(r2t) if r2t else defaults.rollout_to_train_s,
            train_to_rollout_s=statistics.median(t2r) if t2r else defaults.train_to_rollout_s)

    def consult(self, step: int, round_: int, backlog_tokens: int) -> list[RoleChange]:
        """Ask the policy (at a step's start always, mid-step every scheduler.interval_s) and flip."""
        now = time.monotonic()
        if round_ > 0 and now - self._last_consult < self.cfg.scheduler.interval_s:
            return []
        self._last_consult = now
        changes = [ch for ch in self.policy(self.cluster_state(step, backlog_tokens))
                   if next(c for c in self.cells if c.id == ch.cell).role is not Role(ch.to)]
        if changes:
            self.flip(step, round_, changes)
        return changes

    def _measure(self, replies: dict[int, protocol.RoundReport]) -> None:
        by_cell: dict[int, list[protocol.RoundReport]] = {}
        for rank, rep in replies.items():
            by_cell.setdefault(cell_of_rank(self.cells, rank).id, []).append(rep)
        for cid, reps in by_cell.items():
            seconds = max(r.seconds for r in reps)
            if seconds <= 0:
                continue
            train, rollout = sum(r.tokens for r in reps), sum(r.rollout_tokens for r in reps)
            if train:
                self._train_rate[cid] = train / seconds
            if rollout:
                self._rollout_rate[cid] = rollout / seconds

    def flip(self, step: int, round_: int, changes: list[RoleChange]) -> list[FlipRecord]:
        new = with_roles(self.cells, {ch.cell: Role(ch.to) for ch in changes})  # refuses forbidden flips
        start = time.time()
        self.metrics.append([TimelineRow(time=start, cell=ch.cell, role=Role(ch.to).value, event="flip_start",
                                         step=step, detail=ch.reason[:160]) for ch in changes])
        cmd = protocol.Flip(step=step, changes=tuple((ch.cell, Role(ch.to).value) for ch in changes),
                            checksums=self.verify_weights)
        self.broadcast(cmd)
        replies = self.collect()
        end = time.time()
        self.cells = new
        self._check_train_comm(replies)
        source = core_cell(new).leader
        records = []
        for ch in changes:
            cell = next(c for c in new if c.id == ch.cell)
            reps = [replies[r] for r in cell.ranks]
            rec = FlipRecord(cell=cell.id, to=cell.role.value, step=step, round=round_, start=start, end=end,
                             duration_s=max(r.seconds for r in reps), bytes=sum(r.bytes_in for r in reps),
                             comm_s=max(r.comm_s for r in reps), transfer_s=max(r.transfer_s for r in reps),
                             checksum=replies[cell.leader].checksum, source_checksum=replies[source].checksum)
            records.append(rec)
        self.metrics.append([TimelineRow(time=end, cell=r.cell, role=r.to, event="flip_end", step=step,
                                         duration_s=r.duration_s, bytes=r.bytes,
                                         detail=f"round {r.round}") for r in records])
        self.result.flips.extend(records)
        return records

    def _check_train_comm(self, replies: dict[int, protocol.FlipReport]) -> None:
        """Every rank's train_comm must hold exactly the TRAIN cells' ranks, core leader first."""
        expected = tuple(train_ranks(self.cells))
        for rank, rep in replies.items():
            want = expected if rank in expected else None
            if rep.train_members != want:
                raise RuntimeError(f"rank {rank} holds train_comm {rep.train_members}, expected {want} "
                                   f"for TRAIN cells {[c.id for c in self.cells if c.role is Role.TRAIN]}")
        self.result.train_comm_checks += 1

    # ---- steps -----------------------------------------------------------------------
    def micro_batches_per_step(self) -> int:
        """Enough micro-batches for every rank that could train to take one per round."""
        plan = self.cfg.cells
        return max(2, plan.count * plan.ranks_per_cell)

    def run_step(self, step: int) -> StepRecord | None:
        """One training step; None when an exit request interrupted it (nothing of it is kept)."""
        t0 = time.perf_counter()
        total = self.micro_batches_per_step()
        self.consult(step, 0, total * self._tokens_per_micro_batch)
        self.broadcast(protocol.BeginStep(step))
        self.collect()
        pending = list(range(total))
        done_by: dict[int, list[int]] = {}
        losses: dict[int, float] = {}
        mb_tokens: dict[int, int] = {}
        round_ = 0
        while pending:
            if round_ > 0:
                before = {c.id: c.role for c in self.cells}
                self.consult(step, round_, len(pending) * self._tokens_per_micro_batch)
                for c in self.cells:
                    if before[c.id] is Role.TRAIN and c.role is not Role.TRAIN:
                        for r in c.ranks:                       # hand back its micro-batches
                            for mb in done_by.pop(r, []):
                                pending.append(mb)
                                losses.pop(mb, None)
                                mb_tokens.pop(mb, None)
                    if before[c.id] is not Role.TRAIN and c.role is Role.TRAIN:
                        for r in c.ranks:
                            done_by.pop(r, None)
            if self.exit_requested():
                self.broadcast(protocol.AbortStep(step))
                self.collect()
                return None
            ranks = train_ranks(self.cells)
            assign = {r: (mb,) for r, mb in zip(ranks, pending)}
            pending = pending[len(assign):]
            self.broadcast(protocol.Round(step=step, round=round_, assign=assign))
            replies = self.collect()
            self._measure(replies)
            for rank, rep in replies.items():
                if rep.losses:
                    done_by.setdefault(rank, []).extend(rep.losses)
                    losses.update(rep.losses)
                    self._tokens_per_micro_batch = rep.tokens // len(rep.losses)
                    mb_tokens.update((mb, self._tokens_per_micro_batch) for mb in rep.losses)
            round_ += 1
        self.broadcast(protocol.EndStep(step=step, micro_batches=total, checksums=self.verify_weights))
        ends = self.collect()
        self.policy_version += 1
        return StepRecord(step=step, wall_s=time.perf_counter() - t0, loss=sum(losses.values()) / len(losses),
                          train_cells=tuple(c.id for c in self.cells if c.role is Role.TRAIN),
                          tokens=sum(mb_tokens.values()),
                          policy_version=self.policy_version,
                          checksums={r: e.checksum for r, e in ends.items()} if self.verify_weights else None)

    def save_checkpoint(self, step: int) -> Path:
        if step == self.last_checkpointed:
            return self.run.checkpoints / checkpoint.step_dir_name(step)
        staging = checkpoint.staging_dir(self.run.checkpoints, step)
        self.broadcast(protocol.SaveCheckpoint(step=step, directory=str(staging)))
        self.collect()
        meta = checkpoint.CheckpointMeta(step=step, policy_version=self.policy_version,
                                         roles={str(c.id): c.role.value for c in self.cells})
        final = checkpoint.commit(self.run.checkpoints, step, meta, keep=self.keep_checkpoints)
        self.last_checkpointed = step
        # Step rows are written once their step is sealed: a fleet killed before the checkpoint
        # reruns those steps after the relaunch, and their rows must not appear twice.
        self.metrics.append(self._unsealed_rows)
        self._unsealed_rows = []
        return final

    def stop(self, code: int) -> FleetResult:
        self.mark_cells("end", self.result.last_completed)
        self.broadcast(protocol.Stop(code))
        self.result.exit_code = code
        return self.result

    def mark_cells(self, event: str, step: int) -> None:
        """``start``/``end`` timeline rows: each cell's role when this fleet launch begins and
        ends (the simulator writes the same), so analysis neither guesses the roles a resumed
        run starts with nor counts the time between launches as any role."""
        now = time.time()
        self.metrics.append([TimelineRow(time=now, cell=c.id, role=c.role.value, event=event, step=step,
                                         detail=c.kind.value) for c in self.cells])

    def serve(self) -> FleetResult:
        steps = self.cfg.train.steps
        step = self.start_step
        self.mark_cells("start", step)
        while step <= steps:
            if self.exit_requested():
                break
            rec = self.run_step(step)
            if rec is None:
                break
            self.result.steps.append(rec)
            self.result.last_completed = step
            self._unsealed_rows.append(StepRow(step=step, time=time.time(), wall_s=rec.wall_s, tokens=rec.tokens,
                                               replicas=len(rec.train_cells), loss=rec.loss,
                                               policy_version=rec.policy_version))
            print(f"[fleet] step {step}/{steps} loss {rec.loss:.5f} train cells {list(rec.train_cells)} "
                  f"{rec.wall_s:.2f}s", flush=True)
            if step % self.cfg.train.checkpoint_every == 0 or step == steps:
                self.save_checkpoint(step)
            step += 1
        if self.result.last_completed >= steps:
            return self.stop(EXIT_DONE)
        # Asked to stop: seal the last completed step (a no-op if it was just checkpointed).
        self.save_checkpoint(self.result.last_completed)
        print(f"[fleet] {CHECKPOINT_AND_EXIT}: checkpointed step {self.result.last_completed}, exiting "
              f"{EXIT_CHECKPOINTED}", flush=True)
        return self.stop(EXIT_CHECKPOINTED)

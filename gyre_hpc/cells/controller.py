"""Rank 0 of the fleet: one protocol for every workload (substrate smoke test, RL).

The controller owns the messaging (every command owes a reply; a rank that stays silent past
``reply_timeout_s`` fails the fleet, naming the rank and the command it owed), the cells'
roles (asking the policy, flipping with re-derived communicators and the weight broadcast),
checkpoints, the stop, and the loop over steps. What a step does is a workload's
``StepDriver``: the substrate's rounds (``gyre_hpc.substrate.driver``) or the RL workload's
rollouts and streaming training (``gyre_hpc.rl.driver``); both plug in from above.
The controller is the only writer of ``metrics.h5`` while the fleet runs.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mpi4py import MPI

from gyre_hpc.cells import checkpoint, protocol
from gyre_hpc.cells.plan import Cell, core_cell, train_ranks, with_roles
from gyre_hpc.config import RunConfig
from gyre_hpc.rundir.contract import EXIT_CHECKPOINTED, EXIT_DONE
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter, TimelineRow
from gyre_hpc.sched.state import ClusterState, Policy, Role, RoleChange



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
    reason: str = ""
    in_place: bool = False   # joined without the replicas (``Controller.flip_begin``)
    weights_only: bool = False   # ...holding the core's weights but not its moments


@dataclass
class PendingFlip:
    """A flip sent and not yet answered by every rank in it (``Controller.flip_begin``)."""

    step: int
    round: int
    changes: list[RoleChange]
    new_cells: tuple[Cell, ...]
    targets: list[int]
    start: float
    in_place: bool = False
    weights_only: frozenset[int] = frozenset()
    replies: dict[int, protocol.FlipReport] = field(default_factory=dict)

    @property
    def answered(self) -> bool:
        return all(r in self.replies for r in self.targets)


@dataclass(frozen=True)
class StepRecord:
    """What a step driver returns for a step; a workload's own record adds its fields."""

    step: int
    wall_s: float
    loss: float
    train_cells: tuple[int, ...]
    tokens: int
    policy_version: int
    checksums: dict[int, str] | None = None   # world rank -> state checksum after the step
    # world rank -> checksum of the weights alone (every TRAIN rank's, weights-only ones too)
    weights_checksums: dict[int, str] | None = None


@dataclass
class FleetResult:
    exit_code: int
    first_step: int
    last_completed: int
    flips: list[FlipRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)      # the driver's step records
    train_comm_checks: int = 0
    totals: dict[str, int] = field(default_factory=dict)     # the workload's own counts over the launch


class StepDriver(Protocol):
    """What a workload does on the controller rank; the controller does the rest."""

    def begin(self) -> None:
        """Before the first step of this launch (e.g. open engines for requests)."""

    def run_step(self, step: int) -> StepRecord | None:
        """One step; its record, or None when an exit request interrupted it (nothing of the
        step is kept)."""

    def checkpoint_contents(self, step: int, staging: Path) -> tuple[list[str], dict]:
        """Called after the core cell wrote its state into ``staging``: extra files written
        there by the driver and the meta's ``files`` list and ``extra`` dict."""

    def sealed(self, step: int) -> None:
        """The checkpoint of ``step`` is committed."""

    def before_stop(self) -> None:
        """Bring every cell rank back to the command loop (e.g. pause engines)."""


def command_label(cmd) -> str:
    return type(cmd).__name__ + (f" (step {cmd.step})" if hasattr(cmd, "step") else "")


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
    driver: StepDriver | None = None
    result: FleetResult = field(init=False)
    _exit_requested: bool = field(default=False, init=False)
    _last_control_check: float = field(default=0.0, init=False)
    _owed: dict[int, deque] = field(default_factory=dict, init=False)    # rank -> (command, sent at)
    _inbox: deque = field(default_factory=deque, init=False)             # (rank, reply) not yet taken
    _pending_flip: PendingFlip | None = field(default=None, init=False)  # its replies go to it, not the inbox
    # Ranks that joined TRAIN in place and are not in the replicas' train_comm yet: the next
    # meeting of every TRAIN rank (a flip they all take part in, or ``train_comm_met``) has
    # them re-derive it together.
    train_comm_behind: frozenset[int] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        self.result = FleetResult(exit_code=-1, first_step=self.start_step, last_completed=self.start_step - 1)
        self.cell_ranks = [r for c in self.cells for r in c.ranks]

    # ---- messaging -------------------------------------------------------------------
    def send(self, rank: int, cmd, reply: bool = True) -> None:
        """One command to one cell rank; unless ``reply=False`` (Stop) it owes a reply."""
        self.world.send(cmd, dest=rank, tag=protocol.TAG_COMMAND)
        if reply:
            self._owed.setdefault(rank, deque()).append((command_label(cmd), time.monotonic()))

    def broadcast(self, cmd, ranks: list[int] | None = None, reply: bool = True) -> None:
        for r in self.cell_ranks if ranks is None else ranks:
            self.send(r, cmd, reply)

    def owed(self, rank: int) -> int:
        return len(self._owed.get(rank, ()))

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        late = [(r, q[0][0]) for r, q in sorted(self._owed.items()) if q and now - q[0][1] > self.reply_timeout_s]
        if late:
            ranks = [r for r, _ in late]
            owed = "; ".join(f"rank {r}: {label}" for r, label in late)
            raise TimeoutError(f"cell ranks {ranks} did not answer {late[0][1]} within {self.reply_timeout_s:g} s "
                               f"(owed replies: {owed})")

    def _receive(self) -> bool:
        status = MPI.Status()
        if not self.world.Iprobe(source=MPI.ANY_SOURCE, tag=protocol.TAG_REPLY, status=status):
            return False
        rank = status.Get_source()
        msg = self.world.recv(source=rank, tag=protocol.TAG_REPLY)
        queue = self._owed.get(rank)
        if not queue:
            raise RuntimeError(f"cell rank {rank} sent {type(msg).__name__} but owed no reply")
        queue.popleft()
        if self._pending_flip is not None and isinstance(msg, protocol.FlipReport):
            self._pending_flip.replies[rank] = msg
        else:
            self._inbox.append((rank, msg))
        return True

    def poll_replies(self) -> list[tuple[int, object]]:
        """Replies that have arrived, in order; raises when an owed reply is overdue."""
        while self._receive():
            pass
        self._check_deadlines()
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def collect(self, ranks: list[int] | None = None) -> dict[int, object]:
        """The reply to the latest command sent to each of ``ranks`` (default: every cell
        rank), watching the control directory while waiting.

        Replies arrive in the order of the commands, so a rank's reply to its latest command
        is the one that leaves it owing nothing; earlier ones (a replica's micro-batch reports
        queued before a Flip) stay in the inbox for ``poll_replies``. A rank that is alive
        but never answers (stuck in a collective, a deadlocked workload) would hold the fleet
        forever; past ``reply_timeout_s`` the controller raises, naming the silent ranks and
        what they owed, and the fleet aborts for a relaunch.
        """
        want = list(self.cell_ranks if ranks is None else ranks)
        pause = 0.0002
        while any(self._owed.get(r) for r in want):
            if self._receive():
                pause = 0.0002
                continue
            self._check_deadlines()
            self.exit_requested(now=False)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        replies: dict[int, object] = {}
        kept: deque = deque()
        for rank, msg in reversed(self._inbox):
            if rank in want and rank not in replies:
                replies[rank] = msg
            else:
                kept.appendleft((rank, msg))
        self._inbox = kept
        missing = [r for r in want if r not in replies]
        if missing:
            raise RuntimeError(f"collect: cell ranks {missing} owed no reply (nothing was sent to them)")
        return replies

    def exit_requested(self, now: bool = True) -> bool:
        """Has the supervisor asked for checkpoint-and-exit? Always looked up at step and round
        boundaries; while waiting for replies (``now=False``) at most every ``control_poll_s``."""
        t = time.monotonic()
        if not self._exit_requested and (now or t - self._last_control_check >= self.control_poll_s):
            self._last_control_check = t
            self._exit_requested = self.run.exit_request.exists() or self.head_gone()
        return self._exit_requested

    def head_gone(self) -> bool:
        """The head's lease (``control/head-alive``) has not been renewed for
        ``supervise.head_lease_s``: the head died however it died, and the fleet checkpoints
        and exits instead of running on unsupervised. No lease file: no head (a fleet run by
        hand or a test), nothing to watch."""
        lease = self.cfg.supervise.head_lease_s
        try:
            age = time.time() - self.run.head_alive.stat().st_mtime
        except OSError:
            return False
        if not lease or age <= lease:
            return False
        self.metrics.event("head_gone", step=self.result.last_completed,
                           detail=f"the head's lease is {age:.0f}s old (> supervise.head_lease_s={lease:g}): "
                                  f"checkpoint and exit")
        print(f"[fleet] the head's lease is {age:.0f}s old: the head is gone; checkpointing and exiting", flush=True)
        return True

    # ---- policy and flips ------------------------------------------------------------
    def cell(self, cid: int) -> Cell:
        return next(c for c in self.cells if c.id == cid)

    def decide(self, state: ClusterState) -> list[RoleChange]:
        """The policy's changes that would change a role (the policy may repeat a current one)."""
        return [ch for ch in self.policy(state) if self.cell(ch.cell).role is not Role(ch.to)]

    def flip(self, step: int, round_: int, changes: list[RoleChange],
             bystanders: frozenset[int] = frozenset()) -> list[FlipRecord]:
        """Re-derived train_comm, weights from the core cell to the joiners; returns when every
        rank in it has answered (``flip_begin`` + ``flip_end`` for a caller that keeps working
        meanwhile)."""
        pending = self.flip_begin(step, round_, changes, bystanders)
        pause = 0.0002
        while not self.flip_ready(pending):
            self.exit_requested(now=False)
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
        return self.flip_end(pending)

    def flip_begin(self, step: int, round_: int, changes: list[RoleChange],
                   bystanders: frozenset[int] = frozenset(), in_place: bool = False,
                   weights_only: frozenset[int] = frozenset()) -> PendingFlip:
        """Send the flip and return at once: the ranks answer once they reach it (a replica
        after the micro-batch in hand), and the caller keeps the rest of the fleet working.

        Every rank of a TRAIN cell (before or after) and of a flipping cell takes part;
        ``bystanders`` (ranks of ROLLOUT cells that stay ROLLOUT) may be left out: the
        communicators are built by their members only, so those engines keep decoding. One
        flip at a time; the roles change at ``flip_end``.

        ``in_place``: every change is ROLLOUT -> TRAIN of a cell whose ranks already hold the
        core's whole state (the caller knows: they applied the last update with it). Only the
        joiners take part, so they train at once instead of waiting for every replica's
        micro-batch in hand; the train_comm is re-derived when the TRAIN ranks next meet
        (``train_comm_behind``). ``weights_only``: joiners in place among them that hold the
        core's weights but not its optimizer moments (``protocol.Flip.weights_only``).
        """
        if self._pending_flip is not None:
            raise RuntimeError(f"flip of step {step}: the flip of step {self._pending_flip.step} is still in flight")
        new = with_roles(self.cells, {ch.cell: Role(ch.to) for ch in changes})  # refuses forbidden flips
        flipping = {ch.cell for ch in changes}
        if in_place:
            wrong = [ch.cell for ch in changes if Role(ch.to) is not Role.TRAIN or self.cell(ch.cell).role is Role.TRAIN]
            if wrong:
                raise ValueError(f"flip of cells {sorted(flipping)}: only ROLLOUT -> TRAIN joins go in place, "
                                 f"not cells {wrong}")
            needed = {r for c in new if c.id in flipping for r in c.ranks}
        else:
            needed = {r for c in self.cells + new if c.role is Role.TRAIN or c.id in flipping for r in c.ranks}
        if weights_only and not (in_place and weights_only <= flipping):
            raise ValueError(f"flip of cells {sorted(flipping)}: weights-only joiners {sorted(weights_only)} "
                             f"must be joiners in place")
        if needed & set(bystanders):
            raise ValueError(f"flip of cells {sorted(flipping)}: ranks {sorted(needed & set(bystanders))} must take "
                             f"part (TRAIN or flipping), they cannot be bystanders")
        targets = [r for r in self.cell_ranks if r in needed] if in_place else \
            [r for r in self.cell_ranks if r not in bystanders]
        start = time.time()
        self.metrics.append([TimelineRow(time=start, cell=ch.cell, role=Role(ch.to).value, event="flip_start",
                                         step=step, detail=ch.reason[:160]) for ch in changes])
        cmd = protocol.Flip(step=step, changes=tuple((ch.cell, Role(ch.to).value) for ch in changes),
                            checksums=self.verify_weights,
                            before=tuple((c.id, c.role.value) for c in self.cells), in_place=in_place,
                            updates=self.policy_version if in_place else -1, weights_only=tuple(sorted(weights_only)))
        self._pending_flip = PendingFlip(step, round_, list(changes), new, targets, start, in_place, weights_only)
        self.broadcast(cmd, targets)
        return self._pending_flip

    def flip_ready(self, pending: PendingFlip) -> bool:
        """Whether every rank in ``pending`` has answered (takes what has arrived; raises when
        an owed reply is overdue)."""
        while self._receive():
            pass
        self._check_deadlines()
        return pending.answered

    def flip_end(self, pending: PendingFlip) -> list[FlipRecord]:
        """The answered flip: the new roles, the train_comm checked, the records logged."""
        if not pending.answered or pending is not self._pending_flip:
            raise RuntimeError(f"flip_end of step {pending.step}: not every rank has answered")
        self._pending_flip = None
        replies = pending.replies
        end = time.time()
        self.cells = pending.new_cells
        if pending.in_place:
            self._check_in_place(replies)
        else:
            self._check_train_comm({r: rep.train_members for r, rep in replies.items()})
        source = core_cell(self.cells).leader
        records = []
        for ch in pending.changes:
            cell = self.cell(ch.cell)
            reps = [replies[r] for r in cell.ranks]
            records.append(FlipRecord(
                cell=cell.id, to=cell.role.value, step=pending.step, round=pending.round, start=pending.start,
                end=end, duration_s=max(r.seconds for r in reps), bytes=sum(r.bytes_in for r in reps),
                comm_s=max(r.comm_s for r in reps), transfer_s=max(r.transfer_s for r in reps),
                checksum=replies[cell.leader].checksum,
                source_checksum=replies[source].checksum if source in replies else None,
                reason=ch.reason, in_place=pending.in_place, weights_only=cell.id in pending.weights_only))
        self.metrics.append([TimelineRow(time=end, cell=r.cell, role=r.to, event="flip_end", step=pending.step,
                                         duration_s=r.duration_s, bytes=r.bytes,
                                         detail=f"round {r.round}" + (" in place" if r.in_place else "")
                                         + (", weights only" if r.weights_only else ""))
                             for r in records])
        self.result.flips.extend(records)
        return records

    def _check_train_comm(self, members: dict[int, tuple[int, ...] | None]) -> None:
        """Every rank's train_comm must hold exactly the TRAIN cells' ranks, core leader first."""
        expected = tuple(train_ranks(self.cells))
        for rank, held in members.items():
            want = expected if rank in expected else None
            if held != want:
                raise RuntimeError(f"rank {rank} holds train_comm {held}, expected {want} "
                                   f"for TRAIN cells {[c.id for c in self.cells if c.role is Role.TRAIN]}")
        self.result.train_comm_checks += 1
        self.train_comm_behind = frozenset()

    def _check_in_place(self, replies: dict[int, protocol.FlipReport]) -> None:
        """A joiner in place holds no train_comm until the TRAIN ranks next meet."""
        held = {rank: rep.train_members for rank, rep in replies.items() if rep.train_members is not None}
        if held:
            raise RuntimeError(f"ranks {sorted(held)} joined TRAIN in place but hold train_comm {held}")
        self.train_comm_behind |= frozenset(replies)

    def train_comm_met(self, members: dict[int, tuple[int, ...]]) -> None:
        """Every TRAIN rank re-derived train_comm together (a workload's meeting, such as the
        RL step's allreduce); ``members``: each rank's train_comm as it reports it."""
        missing = set(train_ranks(self.cells)) - set(members)
        if missing:
            raise RuntimeError(f"ranks {sorted(missing)} of TRAIN cells did not re-derive train_comm with the others")
        self._check_train_comm(members)

    # ---- checkpoints, stop, the loop over steps ----------------------------------------
    def save_checkpoint(self, step: int, extra: dict | None = None) -> Path:
        """The core cell writes its state into a staging directory; the driver adds its
        files; the commit makes it ``latest``. Only the core cell's ranks take part."""
        if step == self.last_checkpointed:
            return self.run.checkpoints / checkpoint.step_dir_name(step)
        staging = checkpoint.staging_dir(self.run.checkpoints, step)
        core = core_cell(self.cells)
        self.broadcast(protocol.SaveCheckpoint(step=step, directory=str(staging),
                                               extra={"step": step, "policy_version": self.policy_version}),
                       ranks=list(core.ranks))
        self.collect(list(core.ranks))
        files, extra = self.driver.checkpoint_contents(step, staging)
        meta = checkpoint.CheckpointMeta(step=step, policy_version=self.policy_version,
                                         roles={str(c.id): c.role.value for c in self.cells},
                                         files=files, extra=extra)
        final = checkpoint.commit(self.run.checkpoints, step, meta, keep=self.keep_checkpoints)
        self.last_checkpointed = step
        self.driver.sealed(step)
        return final

    def stop(self, code: int) -> FleetResult:
        self.driver.before_stop()
        self.mark_cells("end", self.result.last_completed)
        self.broadcast(protocol.Stop(code), reply=False)
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
        self.driver.begin()
        while step <= steps and not self.exit_requested():
            rec = self.driver.run_step(step)
            if rec is None:
                break
            self.result.steps.append(rec)
            self.result.last_completed = step
            due = step % self.cfg.train.checkpoint_every == 0 or step == steps
            if due:
                self.save_checkpoint(step)
            step += 1
        if self.result.last_completed >= steps:
            return self.stop(EXIT_DONE)
        # Asked to stop: seal the last completed step (a no-op if it was just checkpointed).
        if self.result.last_completed >= self.start_step:
            self.save_checkpoint(self.result.last_completed)
        print(f"[fleet] {self.run.exit_request.name}: checkpointed step {self.result.last_completed}, exiting "
              f"{EXIT_CHECKPOINTED}", flush=True)
        return self.stop(EXIT_CHECKPOINTED)

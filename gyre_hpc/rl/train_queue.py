"""The training side of a step: a finished group's trees committed to ``trees.zarr`` and cut
into micro-batches, dealt to the TRAIN replicas by measured speed while other runs still roll
out, and their reports taken back.

Replicas get store indices, not trees (``MicroBatchRef``), and read the trees themselves, so
this rank stays the store's only writer and sends a few bytes per micro-batch. A replica that
leaves TRAIN mid-step drops its gradients in the flip; ``hand_back`` puts its share back in
front of the queue for the others to redo.
"""
from __future__ import annotations

import time

from gyre_hpc.cells.controller import Controller
from gyre_hpc.cells.plan import Cell, cell_of_rank, train_ranks
from gyre_hpc.rl import messages
from gyre_hpc.rl.batches import (ReplicaSpeeds, admit_group, finest_rows, group_micro_batches, group_refs,
                                 largest_first, pick_replica)
from gyre_hpc.rl.step_state import RunOutcome, StepState
from gyre_hpc.trees.store import TreeStore


class TrainQueue:
    def __init__(self, fleet: Controller, store: TreeStore):
        self.fleet, self.cfg, self.store = fleet, fleet.cfg, store
        self.speeds = ReplicaSpeeds()
        self.trained_in_window: dict[int, int] = {}   # rank -> tokens trained since the last engines row
        self._run_tokens = (0, 0)                     # (training tokens, runs) of the groups committed so far
        self._busy_until: dict[int, float] = {}       # rank -> when what it holds is predicted done (monotonic)
        self.peak_rss_kib = 0                         # the largest peak memory a replica reported

    def commit_group(self, st: StepState, outs: list[RunOutcome]) -> None:
        """Store (unless already stored), cut into micro-batches for the replicas."""
        self.store_group(outs)
        trees = [o.tree for o in outs]
        indices = [o.store_index for o in outs]
        # Packed here only for the token counts that dealing needs; replicas read the trees
        # from the store by these indices and pack them the same way (pure function).
        tc = self.cfg.train
        rows, budget = tc.row_tokens, tc.micro_batch_tokens
        groups = len({sp.group for sp in st.specs})
        st.groups_committed += 1
        if (groups - st.groups_committed + 1) * len(outs) <= len(self.fleet.cells):
            # The step's last groups (their runs no more than the cells that could train them):
            # every replica should end the step with a piece of them, so they are cut as fine as
            # their trees allow (about a run a micro-batch; the rows repeat a little context).
            rows = budget = min(rows, finest_rows(trees, tc.group_forest))
        mbs = group_micro_batches(trees, st.step, st.next_mb, rows, budget, tc.shared_targets, tc.averaging,
                                  tc.group_forest)
        st.next_mb += len(mbs)
        st.store_end = max([st.store_end, *(i + 1 for i in indices)])
        st.pending.extend(group_refs(indices, mbs, rows, budget))
        st.groups_changed = True
        tokens, runs = self._run_tokens
        self._run_tokens = (tokens + sum(mb.tokens for mb in mbs), runs + len(outs))

    def store_group(self, outs: list[RunOutcome]) -> bool:
        """Admit a finished group and append its trees to the store in one commit; each outcome
        then names its store index. A group is committed whole, so it is stored or not; returns
        whether this call appended it."""
        if all(o.stored for o in outs):
            return False
        trees = admit_group([o.tree for o in outs], self.cfg.train.max_paths_per_run)
        for o, t, i in zip(outs, trees, self.store.append(trees)):
            o.tree, o.stored, o.store_index = t, True, i
        return True

    def store_ahead(self, current: StepState, ahead: StepState) -> None:
        """The groups a step rolling out ahead holds go into the store once every tree of the
        current step is there (the store stays in step order, which a relaunch's exactly-once
        read relies on). Stored while the current step trains, the ahead step's start finds
        only the cut left: a group's durable append costs ~0.14 s here (Zarr's chunk writes,
        half of it their fsyncs), and a dozen of them at the step boundary held every replica
        idle. One group a call, so the loop pumps between appends."""
        if not current.runs_done:
            return
        for outs in ahead.held:
            if self.store_group(outs):
                return

    def expected_tokens(self, unfinished_runs: int) -> int:
        """Training tokens the unfinished runs will bring, at the mean of the runs so far."""
        tokens, runs = self._run_tokens
        return int(unfinished_runs * tokens / runs) if runs else 0

    def deal(self, st: StepState) -> None:
        """Each pending micro-batch to the replica predicted to finish it first (what it holds,
        then this, at its measured speed), at most ``train.micro_batches_in_hand`` each. Once
        every run of the step is done no more work will come: what is left is dealt largest
        first, and a micro-batch waits for the replica that finishes it first rather than go
        to a slower or busier one that is free."""
        replicas = train_ranks(self.fleet.cells)
        if st.runs_done:
            st.pending[:] = largest_first(st.pending)
        in_hand = self.cfg.train.micro_batches_in_hand
        now = time.monotonic()
        free_at = {r: max(self._busy_until.get(r, now) - now, 0.0) for r in replicas}   # seconds from now
        while st.pending and replicas:
            room = [r for r in replicas if len(st.outstanding.get(r, [])) < in_hand]
            if not room:
                return
            mb = st.pending[0]
            rank = pick_replica(replicas, free_at, self.speeds, mb.tokens)
            if rank not in room:
                if st.runs_done:
                    return
                rank = pick_replica(room, free_at, self.speeds, mb.tokens)
            st.pending.pop(0)
            free_at[rank] += mb.tokens / self.speeds.rate(rank)
            self._busy_until[rank] = now + free_at[rank]
            st.outstanding.setdefault(rank, []).append(mb)
            self.fleet.send(rank, messages.Train(mb, len(replicas)))    # a MicroBatchRef: indices, not trees

    def poll(self, st: StepState, block: bool = False) -> None:
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
                # What it still holds started now (it queued behind the one just reported).
                self._busy_until[rep.rank] = time.monotonic() + sum(m.tokens for m in held) / self.speeds.rate(rep.rank)
                self.peak_rss_kib = max(self.peak_rss_kib, rep.peak_rss_kib)
                self.trained_in_window[rep.rank] = self.trained_in_window.get(rep.rank, 0) + rep.tokens
                if rep.pace is not None:
                    st.replica_pace[rep.rank] = rep.pace
                # One event per micro-batch: when each replica's last one of a step ended is
                # how dealing by speed is checked (every replica finishes together).
                self.fleet.metrics.event("train_mb", step=rep.step,
                                         detail=f"cell={cell_of_rank(self.fleet.cells, rep.rank).id} "
                                                f"rank={rep.rank} mb={rep.mb_id} "
                                                f"tokens={rep.tokens} seconds={rep.seconds:.4f}")
            if not block:
                return
            if not replies:
                time.sleep(0.0005)

    def hand_back(self, st: StepState, left: list[Cell]) -> None:
        """Cells that left TRAIN in a flip dropped their gradients: the others redo their share."""
        for c in left:
            for r in c.ranks:
                st.pending[:0] = st.done_by.pop(r, [])
                for mb in st.outstanding.pop(r, []):
                    st.pending.insert(0, mb)

    def trained_tokens(self, st: StepState) -> int:
        return sum(mb.loss_tokens for v in st.done_by.values() for mb in v)

    def optimizer_step(self, step: int, n_runs: int, version: int, ranks: list[int],
                       weights_from_core: bool = False) -> dict:
        """Allreduce and optimizer step on every TRAIN rank (``weights_from_core``: some hold the
        weights alone and take the updated ones from the core); their replies, checked: a rank
        that reduced over another set of replicas would have averaged the wrong gradients."""
        roles = tuple((c.id, c.role.value) for c in self.fleet.cells) if self.fleet.train_comm_behind else ()
        self.fleet.broadcast(messages.Finish(step, n_runs, version, self.fleet.verify_weights, roles,
                                             weights_from_core), ranks)
        reps = self.fleet.collect(ranks)
        bad = [r for r, rep in reps.items() if int(round(rep.replicas)) != len(ranks)]
        if bad:
            raise RuntimeError(f"step {step}: ranks {bad} reduced over a train_comm that is not the "
                               f"{len(ranks)} TRAIN ranks {ranks}")
        if roles:
            self.fleet.train_comm_met({r: rep.train_members for r, rep in reps.items()})
        return reps

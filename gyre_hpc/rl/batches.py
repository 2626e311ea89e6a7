"""Admission -> packing -> micro-batches, and dealing micro-batches to replicas by speed.

A step's trees arrive an advantage group at a time (a group is trainable once its G runs are
done: advantages are normalised within it). Each group is packed on its own into rows of
``train.row_tokens`` and the rows are cut into micro-batches of at most
``train.micro_batch_tokens``; row ``sample_run`` values index the group's runs, and each
micro-batch carries that group's advantages and per-run target counts, so a replica
computes its exact share of the step loss without seeing the rest of the step. With
``train.group_forest`` the group is packed as one forest (``trees.builder.group_forest``):
the task prompt the runs share is computed once, and the loss is the same.

Dealing: every replica should finish the step's work at the same moment. The controller
keeps each replica's measured training tokens/s and hands the next micro-batch to the replica
that would finish it earliest given when what it holds is predicted done (list scheduling on
predicted finish time); a replica never measured is assumed as fast as the fastest one
measured. Micro-batches are indivisible, so the step's last ones are cut finer
(``finest_rows``: about a run each) to even out the finish, and once no more work will come
they are dealt largest first (``largest_first``): list scheduling then ends on the smallest
pieces, so the replicas' finish differs by about the smallest one, not by whichever came last.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np

from gyre_hpc.rl.trainer import MicroBatch
from gyre_hpc.trees.admission import admit
from gyre_hpc.trees.builder import group_forest, node_depth
from gyre_hpc.trees.loss import group_advantages, run_targets
from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.packing import pack


def admit_group(trees: Sequence[Tree], max_paths: int) -> list[Tree]:
    return [admit(t, max_paths) for t in trees]


def group_micro_batches(trees: Sequence[Tree], step: int, first_id: int, row_tokens: int,
                        micro_batch_tokens: int, shared_targets: str = "per_sample", averaging: str = "run",
                        forest: bool = True) -> list[MicroBatch]:
    """One advantage group's trees as micro-batches (ids from ``first_id``)."""
    if not trees:
        return []
    advantages = group_advantages([t.reward for t in trees], [t.task_id for t in trees])
    run_tokens = np.array([run_targets(t, shared_targets) for t in trees], dtype=np.int64)
    units = [group_forest(trees)] if forest else list(trees)
    rows = [r for r in pack(units, row_tokens, shared_targets) if r.n_loss_tokens > 0]
    out: list[MicroBatch] = []
    current: list = []
    size = 0
    for row in rows:
        if current and size + row.n_tokens > micro_batch_tokens:
            out.append(MicroBatch(step, first_id + len(out), tuple(current), advantages, run_tokens, averaging))
            current, size = [], 0
        current.append(row)
        size += row.n_tokens
    if current:
        out.append(MicroBatch(step, first_id + len(out), tuple(current), advantages, run_tokens, averaging))
    return out


@dataclass
class ReplicaSpeeds:
    """Measured training tokens/s per replica (world rank), smoothed."""

    rates: dict[int, float] = field(default_factory=dict)
    alpha: float = 0.5

    def record(self, rank: int, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens <= 0:
            return
        rate = tokens / seconds
        old = self.rates.get(rank)
        self.rates[rank] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

    def rate(self, rank: int) -> float:
        if rank in self.rates:
            return self.rates[rank]
        return max(self.rates.values(), default=1.0)


def pick_replica(replicas: Iterable[int], free_at: Mapping[int, float], speeds: ReplicaSpeeds,
                 tokens: int) -> int:
    """The replica that would finish ``tokens`` more work earliest: free at ``free_at`` (when
    what it holds is predicted done; absent: now, 0) plus the work at its measured speed (ties:
    lowest rank). List scheduling on predicted finish time."""
    replicas = list(replicas)
    if not replicas:
        raise RuntimeError("no TRAIN replica to hand a micro-batch to")
    return min(replicas, key=lambda r: (free_at.get(r, 0.0) + tokens / speeds.rate(r), r))


def largest_first(pending: Sequence["MicroBatchRef"]) -> list["MicroBatchRef"]:
    """The order to deal a step's last work in: most tokens first, ties in queue order
    (longest-processing-time-first list scheduling)."""
    return sorted(pending, key=lambda mb: -mb.tokens)


def finest_rows(trees: Sequence[Tree], forest: bool = True) -> int:
    """The smallest row budget that packs ``trees`` (as one group forest or tree by tree)
    without a deep row: each unit's deepest path. Rows of this budget cut a group into its
    finest micro-batches (about a run each) while every node keeps its ancestors' context."""
    units = [group_forest(trees)] if forest else list(trees)
    return max((int((node_depth(u) + u.node_len).max()) for u in units if u.n_nodes), default=2)


@dataclass(frozen=True)
class MicroBatchRef:
    """What a replica is dealt: which committed trees (store indices) make the group and which
    of its micro-batches to train. The replica reads the trees from ``trees.zarr`` itself and
    packs them with the same pure ``group_micro_batches``: no tree crosses MPI."""

    step: int
    mb_id: int
    trees: tuple[int, ...]     # store indices of the advantage group, in group order
    first_id: int              # mb_id of the group's first micro-batch
    tokens: int                # packed tokens (for dealing by speed)
    loss_tokens: int
    # The cut the controller made (``group_micro_batches``'s budgets); 0: the run's config.
    row_tokens: int = 0
    micro_batch_tokens: int = 0


def group_refs(indices: Sequence[int], mbs: Sequence[MicroBatch], row_tokens: int = 0,
               micro_batch_tokens: int = 0) -> list[MicroBatchRef]:
    first = mbs[0].mb_id if mbs else 0
    return [MicroBatchRef(mb.step, mb.mb_id, tuple(int(i) for i in indices), first, mb.tokens, mb.loss_tokens,
                          row_tokens, micro_batch_tokens) for mb in mbs]


class StoreMicroBatches:
    """Replica side: micro-batches from the store, by the indices the controller dealt.

    Trusts only what the commit marker covers (re-read when an index is past it); one group's
    micro-batches are packed once and kept until the group's last one is trained.
    """

    def __init__(self, store_path, row_tokens: int, micro_batch_tokens: int, shared_targets: str = "per_sample",
                 averaging: str = "run", forest: bool = True):
        self.store_path = store_path
        self.row_tokens, self.micro_batch_tokens = row_tokens, micro_batch_tokens
        # The controller's packing settings: both sides must cut the group identically.
        self.shared_targets, self.averaging, self.forest = shared_targets, averaging, forest
        self._store = None
        self._groups: dict[tuple[int, int], dict[int, MicroBatch]] = {}

    @classmethod
    def of(cls, store_path, train) -> "StoreMicroBatches":
        """With the packing settings of ``train`` (a ``TrainConfig``), as the controller packs."""
        return cls(store_path, train.row_tokens, train.micro_batch_tokens, train.shared_targets, train.averaging,
                   train.group_forest)

    def _open(self):
        from gyre_hpc.trees.store import TreeStore

        if self._store is None:
            self._store = TreeStore.open(self.store_path, "r")
        return self._store

    def get(self, ref: MicroBatchRef) -> MicroBatch:
        key = (ref.step, ref.first_id)
        if key not in self._groups:
            store = self._open()
            if max(ref.trees) >= len(store) and max(ref.trees) >= store.refresh():
                raise RuntimeError(f"micro-batch {ref.mb_id} of step {ref.step}: tree {max(ref.trees)} is past the "
                                   f"commit marker of {self.store_path} ({len(store)} trees committed)")
            trees = [store.read(i) for i in ref.trees]
            mbs = group_micro_batches(trees, ref.step, ref.first_id, ref.row_tokens or self.row_tokens,
                                      ref.micro_batch_tokens or self.micro_batch_tokens, self.shared_targets,
                                      self.averaging, self.forest)
            self._groups[key] = {mb.mb_id: mb for mb in mbs}
        group = self._groups[key]
        mb = group.pop(ref.mb_id)
        if not group:
            del self._groups[key]
        return mb

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

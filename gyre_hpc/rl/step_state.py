"""What one RL step holds while it runs, and the record it leaves.

``StepState`` is the one mutable object the step's parts share (rollouts fill ``outcomes``,
the training queue moves micro-batches between ``pending``, ``outstanding`` and ``done_by``,
flips append to ``flips``); keeping it a plain dataclass lets each part be read alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gyre_hpc.cells.controller import FlipRecord, StepRecord
from gyre_hpc.rl.batches import MicroBatchRef
from gyre_hpc.rl.router_client import CountingRunClient
from gyre_hpc.rl.runs import RunSpec
from gyre_hpc.trees.loss import LogprobGap
from gyre_hpc.trees.model import Tree


@dataclass
class RunOutcome:
    spec: RunSpec
    tree: Tree
    migrations: int = 0
    restarts: int = 0
    calls: int = 0
    model_s: float = 0.0
    stored: bool = False       # its tree is in trees.zarr at store_index (read back, or stored ahead)
    store_index: int = -1
    resumed_calls: int = 0     # resumed after a relaunch: calls replayed from its journal
    tools_redone: int = 0      # ... whose tools ran again (after its workspace snapshot)
    restarted_from_first: bool = False   # its journal was abandoned: it began again at call 0


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
    next_mb: int = 0
    groups_done: set[int] = field(default_factory=set)
    groups_committed: int = 0   # groups handed to training (a step rolled out ahead holds its first ones)
    groups_changed: bool = False
    start_version: int = 0      # the trainer's newest version when the step's rollouts began
    flips: list[FlipRecord] = field(default_factory=list)
    migrations: list[tuple[int, int, int, float]] = field(default_factory=list)  # (cell, requests, bytes, s)
    run_started: dict[str, float] = field(default_factory=dict)   # run id -> unix time it took its place
    run_calls: dict[str, CountingRunClient] = field(default_factory=dict)  # run id -> its client (calls so far)
    replica_pace: dict[int, dict] = field(default_factory=dict)   # rank -> its pace record (paced cells)
    # False while the step's runs roll out ahead of it (async: during the previous step's
    # training); its finished groups wait in ``held`` to be dealt, and are stored only once
    # the current step's trees all are, so the store stays in step order.
    active: bool = True
    held: list[list[RunOutcome]] = field(default_factory=list)

    @property
    def runs_done(self) -> bool:
        return len(self.outcomes) == len(self.specs)

    @property
    def all_started(self) -> bool:
        """Every run has taken its place (or is done): the next batch may launch behind it."""
        return all(s.run_id in self.run_started or s.run_id in self.outcomes for s in self.specs)

    @property
    def unfinished(self) -> int:
        return len(self.specs) - len(self.outcomes)

    @property
    def trained(self) -> bool:
        """Every run done and every micro-batch trained: the step may take its optimizer step."""
        return self.runs_done and not self.pending and not any(self.outstanding.values())

    def backlog_tokens(self) -> int:
        return sum(mb.tokens for mb in self.pending) + sum(mb.tokens for v in self.outstanding.values() for mb in v)

    def outcomes_in_order(self) -> list[RunOutcome]:
        return [self.outcomes[s.run_id] for s in self.specs]


@dataclass(frozen=True, kw_only=True)
class RLStepRecord(StepRecord):
    """The fleet's step record with the RL step's own figures."""

    reward_mean: float
    runs: int
    migrations: int
    restarts: int
    flips: int
    optimizer_s: float = 0.0      # allreduce + optimizer step, as the controller waited for it
    weight_sync_s: float = 0.0    # new weights into every serving engine
    weight_sync_bytes: int = 0    # bytes each engine received
    recomputed_prefill_tokens: int = 0   # prefill the engines did again during the step (0 with KV migration)
    gap: LogprobGap = field(default_factory=LogprobGap)   # trainer vs behaviour logprobs, before the update


def stale_runs(outcomes: list[RunOutcome], version: int, max_staleness: int) -> list[str]:
    """Runs with a sampled token from weights more than ``max_staleness`` versions behind
    ``version`` (the one this update starts from): 0 for on-policy schedules, 1 for async,
    whose runs rolled out while the previous step trained. Checked, not assumed."""
    return [o.spec.run_id for o in outcomes if o.tree.n_paths and version - o.tree.policy_version > max_staleness]

"""What the simulator simulates: the workload, the engines, the trainer, the fleet.

Every figure is a field of a frozen dataclass with a default, and presets are instances
of ``Workload``. docs/sim.md gives the source (or the assumption) behind every default of
the ``paper`` preset. A YAML file (``gyre-hpc sim --workload file.yaml``) overrides fields
by section, which is how measured parameters of a real run are fed in; unknown keys and
wrong types fail naming the field.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gyre_hpc.config import read_yaml_mapping
from gyre_hpc.devices import DeviceError, EngineModel, TrainModel, device_preset
from gyre_hpc.sched.elastic import ElasticParams
from gyre_hpc.sched.tail import DEFAULT_FRACTION as TAIL_FRACTION


class WorkloadError(ValueError):
    """A workload that cannot be simulated; the message names the field."""


@dataclass(frozen=True)
class Dist:
    """A positive, possibly heavy-tailed quantity.

    ``lognormal``: median and sigma of log. ``pareto``: scale ``median / 2**(1/alpha)`` so
    the median is as given, tail index ``alpha`` (smaller = heavier). ``fixed``: always the
    median. ``cap`` truncates (0 = none).
    """
    kind: Literal["lognormal", "pareto", "fixed"] = "lognormal"
    median: float = 1.0
    sigma: float = 0.5
    alpha: float = 2.0
    cap: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("lognormal", "pareto", "fixed"):
            raise WorkloadError(f"kind={self.kind!r}: valid kinds are lognormal, pareto, fixed")
        if self.median <= 0:
            raise WorkloadError(f"median={self.median}: must be > 0")
        if self.sigma < 0 or self.alpha <= 0 or self.cap < 0:
            raise WorkloadError(f"sigma={self.sigma}, alpha={self.alpha}, cap={self.cap}: sigma, cap >= 0, alpha > 0")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            x = np.full(n, self.median, dtype=float)
        elif self.kind == "lognormal":
            x = self.median * np.exp(self.sigma * rng.standard_normal(n))
        else:
            scale = self.median / 2.0 ** (1.0 / self.alpha)
            x = scale * (1.0 + rng.pareto(self.alpha, n))
        return np.minimum(x, self.cap) if self.cap > 0 else x

    def mean(self) -> float:
        """Analytic mean ignoring the cap (the cap only lowers it); used for sizing, not results."""
        if self.kind == "fixed":
            return self.median
        if self.kind == "lognormal":
            return self.median * math.exp(self.sigma ** 2 / 2)
        if self.alpha <= 1:
            return self.cap if self.cap > 0 else math.inf
        scale = self.median / 2.0 ** (1.0 / self.alpha)
        m = scale * self.alpha / (self.alpha - 1)
        return min(m, self.cap) if self.cap > 0 else m


@dataclass(frozen=True)
class RunShape:
    """One agent run: model calls separated by tool/environment time."""
    tasks_per_step: int = 4
    runs_per_task: int = 4                       # G, the advantage group
    calls: Dist = Dist(median=6, sigma=0.6, cap=40)
    output_tokens: Dist = Dist(median=200, sigma=0.5)      # generated per call
    context_tokens: Dist = Dist(median=800, sigma=0.6)     # new prompt tokens per call (tool output, task text)
    tool_s: Dist = Dist(median=2.0, sigma=0.8)             # environment time after each call
    # Wall-clock limit of one run, counted from when an engine first serves it (queueing
    # before that is not the run's time); cut runs are trained as far as they got.
    timeout_s: float = 600.0
    coarsen: int = 1                             # merge this many consecutive calls into one simulated call
    # Tokens the trainer processes per token a run adds to its tree: below 1 where a group
    # forest trains the prompt its runs share once (train.group_forest), above 1 where
    # packed rows repeat ancestors as context. Measured from a run's micro-batches
    # (sim.measure); 1 = trees trained as they are.
    trained_per_token: float = 1.0
    # Runs in progress at once (the harness pool). 0: one batch's worth. A new batch's runs
    # start as runs of the previous batch finish, when the staleness bound lets the batch
    # start at all (continuous async); on-policy batches never overlap.
    max_concurrent_runs: int = 0

    def __post_init__(self) -> None:
        if self.tasks_per_step < 1 or self.runs_per_task < 1:
            raise WorkloadError("run.tasks_per_step and run.runs_per_task must be >= 1")
        if self.timeout_s <= 0:
            raise WorkloadError(f"run.timeout_s={self.timeout_s}: must be > 0")
        if self.coarsen < 1:
            raise WorkloadError(f"run.coarsen={self.coarsen}: must be >= 1")
        if self.trained_per_token <= 0:
            raise WorkloadError(f"run.trained_per_token={self.trained_per_token}: must be > 0")
        if self.max_concurrent_runs < 0:
            raise WorkloadError(f"run.max_concurrent_runs={self.max_concurrent_runs}: must be >= 0 (0 = a batch)")

    @property
    def runs_per_step(self) -> int:
        return self.tasks_per_step * self.runs_per_task


KNOT_FIELDS = ("step_frac", "calls", "tokens", "tool_time", "tail")


@dataclass(frozen=True)
class Knot:
    """The workload's multipliers at one point of the run (``step_frac``: 0 = the first step,
    1 = the last). ``calls`` scales calls per run, ``tokens`` output tokens per call,
    ``tool_time`` the environment time after each call (each a ``Dist``'s
    median); ``tail`` scales the spread of calls per run (a lognormal's sigma; a Pareto's
    tail index is divided by it): above 1 a heavier tail. A ``cap`` never drifts: it is a
    limit the harness sets (a turn cap), not the agent's behaviour, so calls growing past it
    are cut there."""
    step_frac: float
    calls: float = 1.0
    tokens: float = 1.0
    tool_time: float = 1.0
    tail: float = 1.0

    def __post_init__(self) -> None:
        for name in KNOT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise WorkloadError(f"{name}={value!r}: expected a finite number")
        if not 0.0 <= self.step_frac <= 1.0:
            raise WorkloadError(f"step_frac={self.step_frac}: must be in [0, 1] (0 = the first step, 1 = the last)")
        for name in KNOT_FIELDS[1:]:
            if getattr(self, name) <= 0:
                raise WorkloadError(f"{name}={getattr(self, name)}: a multiplier must be > 0")


# Named drifts (docs/sim.md "Drift" gives the published training curves behind each shape;
# the magnitudes were tuned until each moves the paper preset's best static split by >= 2
# cells over the run, which issue 55 asks of them).
DRIFT_SHAPES: dict[str, tuple[Knot, ...]] = {
    # Agents learn to make twice the calls over the run, and each call's tool run grows with
    # them (the environment time per call doubles too).
    "calls-grow-2x": (Knot(0.0), Knot(1.0, calls=2.0, tool_time=2.0)),
    # Runs of one length at first, then a few learn to go on far longer while the median
    # holds: the spread of calls per run grows from a third of the preset's to twice it.
    "tail-thickens": (Knot(0.0, tail=1 / 3), Knot(1.0, tail=2.0)),
    # A heavy spread at first (three times the preset's: 29% of the paper preset's runs
    # reach its 300-call cap) that runs converge out of, to a third of it. From 1x to 1/3 the
    # paper preset's best split moved 1 cell, from 2x to 1/3 by 3 on seed 0 and 1 on seed 1.
    "tail-thins": (Knot(0.0, tail=3.0), Knot(1.0, tail=1 / 3)),
}


@dataclass(frozen=True)
class Drift:
    """A per-step schedule of the run shape's multipliers: ``knots`` interpolated linearly over
    the run's steps (held flat before the first and after the last), or a named ``shape``
    (``DRIFT_SHAPES``). Neither: the workload holds still. Sampling stays seeded per (seed,
    step), so every policy still gets the same runs."""
    shape: str = ""
    knots: tuple[Knot, ...] = ()

    def __post_init__(self) -> None:
        if self.shape and self.knots:
            raise WorkloadError(f"drift.shape={self.shape!r} and drift.knots: give one, not both")
        if self.shape and self.shape not in DRIFT_SHAPES:
            raise WorkloadError(f"drift.shape={self.shape!r}: valid shapes are {', '.join(sorted(DRIFT_SHAPES))}")
        if not isinstance(self.knots, (list, tuple)):
            raise WorkloadError(f"drift.knots: expected a list of knots, got {type(self.knots).__name__}")
        knots = tuple(_knot(k, i) for i, k in enumerate(self.knots))
        for i in range(1, len(knots)):
            if knots[i].step_frac <= knots[i - 1].step_frac:
                raise WorkloadError(f"drift.knots[{i}].step_frac={knots[i].step_frac}: knots must be in increasing "
                                    f"step_frac (the one before is at {knots[i - 1].step_frac})")
        object.__setattr__(self, "knots", knots)   # YAML gives lists of mappings; hashable for the batch cache

    @property
    def points(self) -> tuple[Knot, ...]:
        return DRIFT_SHAPES[self.shape] if self.shape else self.knots

    def at(self, step_frac: float) -> Knot:
        """The multipliers at ``step_frac`` of the run, interpolated between the knots."""
        pts = self.points
        if not pts:
            return Knot(step_frac)
        xs = [k.step_frac for k in pts]
        return Knot(step_frac, **{f: float(np.interp(step_frac, xs, [getattr(k, f) for k in pts]))
                                  for f in KNOT_FIELDS[1:]})


def _knot(k: Any, i: int) -> Knot:
    """A knot from YAML (a mapping) or as given, its errors named by its place in the list."""
    if isinstance(k, Knot):
        return k
    if not isinstance(k, dict):
        raise WorkloadError(f"drift.knots[{i}]: expected a mapping with keys {', '.join(KNOT_FIELDS)}, got {k!r}")
    unknown = sorted(set(k) - set(KNOT_FIELDS))
    if unknown:
        raise WorkloadError(f"drift.knots[{i}].{unknown[0]}: unknown key; valid keys: {', '.join(KNOT_FIELDS)}")
    if "step_frac" not in k:
        raise WorkloadError(f"drift.knots[{i}].step_frac: missing (where in the run, 0..1, the knot sits)")
    try:
        return Knot(**k)
    except WorkloadError as exc:
        raise WorkloadError(f"drift.knots[{i}].{exc}") from None


def _scaled_dist(d: Dist, by: float, tail: float = 1.0) -> Dist:
    return dataclasses.replace(d, median=d.median * by, sigma=d.sigma * tail, alpha=d.alpha / tail)


@dataclass(frozen=True)
class Fleet:
    cells: int = 6                          # core cells included; the same GPU budget for every policy
    # Cells that always train and hold the training state (the core group). 0: the fewest
    # that hold it (``train.min_replicas()``, 1 when training memory is not modelled).
    core_cells: int = 0
    rollout_only: int = 0                   # cells that never train
    rollout_to_train_s: float = 8.5         # switch costs
    train_to_rollout_s: float = 3.5
    # A join in place (the runtime's: the cell holds the last update's weights, having applied
    # it with the replicas or, an engine, been sent them; without the moments it joins weights
    # only): a message, no state moved. None: the same as rollout_to_train_s (one switch cost
    # for every join, as the presets model it).
    in_place_join_s: float | None = None
    # The async baseline's fixed split (train cells, core included): an explicit input, as
    # a user configures scheduler.async_train_cells. 0: none given (async cannot run;
    # `gyre-hpc sim --tune-async` finds the best split by simulation).
    async_train_cells: int = 0
    async_max_staleness: int = 1

    def join_s(self, in_place: bool) -> float:
        """What a ROLLOUT -> TRAIN switch costs: in place (the cell holds the current weights)
        or with the state moved to it."""
        return self.in_place_join_s if in_place and self.in_place_join_s is not None else self.rollout_to_train_s

    def __post_init__(self) -> None:
        if self.cells < 2:
            raise WorkloadError(f"fleet.cells={self.cells}: need >= 2 (the core cell and an engine)")
        if not 0 <= self.rollout_only <= self.cells - 1:
            raise WorkloadError(f"fleet.rollout_only={self.rollout_only}: must be in 0..{self.cells - 1}")
        if self.rollout_to_train_s < 0 or self.train_to_rollout_s < 0 or (self.in_place_join_s or 0) < 0:
            raise WorkloadError("fleet switch costs must be >= 0")
        if self.core_cells < 0 or self.core_cells > self.cells - 1:
            raise WorkloadError(f"fleet.core_cells={self.core_cells}: must be in 0..{self.cells - 1} (0 = as the memory needs)")
        if self.async_train_cells < 0 or self.async_train_cells > self.cells - 1:
            raise WorkloadError(f"fleet.async_train_cells={self.async_train_cells}: must be in 0..{self.cells - 1}")
        if self.async_max_staleness < 0:
            raise WorkloadError(f"fleet.async_max_staleness={self.async_max_staleness}: must be >= 0")


@dataclass(frozen=True)
class PolicyParams:
    """Policy parameters, as the run config's ``scheduler.elastic`` section spells them and
    validated by the same dataclass. The workload's engine and trainer size elastic's
    target occupancy, KV figure and training-rate prior unless these set them."""
    elastic: ElasticParams = ElasticParams()
    # Where elastic's train floor comes from: "given" (``elastic.train_floor_cells`` as set,
    # e.g. a searched split), or "observed" (``sched.observed_floor``: after each step, the
    # split that balances the engine- and replica-seconds the step measured; the simulator
    # feeds it what a runtime controller could measure, never the workload's sampled future).
    floor: str = "given"

    def __post_init__(self) -> None:
        if self.floor not in FLOOR_SOURCES:
            raise WorkloadError(f"policy.floor={self.floor!r}: must be one of {', '.join(FLOOR_SOURCES)}")


FLOOR_SOURCES = ("given", "observed")


@dataclass(frozen=True)
class Workload:
    name: str = "tiny"
    steps: int = 4
    seed: int = 0
    decision_interval_s: float = 5.0     # the controller re-evaluates the policy this often
    engine_sample_s: float = 2.0         # one engines-table row per cell this often
    # The policy's tail (ClusterState.tail_runs): this share of the runs in progress, those
    # expected to finish last, at least one.
    tail_fraction: float = 0.1
    run: RunShape = RunShape()
    engine: EngineModel = EngineModel()
    train: TrainModel = TrainModel()
    fleet: Fleet = Fleet()
    policy: PolicyParams = PolicyParams()
    drift: Drift = Drift()

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise WorkloadError(f"steps={self.steps}: must be >= 1")
        if self.decision_interval_s <= 0 or self.engine_sample_s <= 0:
            raise WorkloadError("decision_interval_s and engine_sample_s must be > 0")
        if not 0 < self.tail_fraction <= 1:
            raise WorkloadError(f"tail_fraction={self.tail_fraction}: must be in (0, 1]")
        need = self.train.min_replicas()
        if self.fleet.core_cells and self.fleet.core_cells < need:
            raise WorkloadError(f"fleet.core_cells={self.fleet.core_cells}: {self.train.memory_shortfall(self.fleet.core_cells)}")
        if self.core_cells + self.fleet.rollout_only > self.fleet.cells - 1:
            raise WorkloadError(f"fleet.cells={self.fleet.cells}: {self.core_cells} core cells (the training state) and "
                                f"fleet.rollout_only={self.fleet.rollout_only} leave no elastic cell")

        if self.run.calls.kind == "fixed" and any(k.tail != 1.0 for k in self.drift.points):
            raise WorkloadError("drift: a tail multiplier on run.calls of kind 'fixed' (no spread) changes nothing; "
                                "give run.calls a lognormal or pareto spread, or leave the knots' tail at 1")

    def step_frac(self, step: int) -> float:
        """Where step ``step`` lies in the run: 0 at the first, 1 at the last."""
        return step / (self.steps - 1) if self.steps > 1 else 0.0

    def run_at(self, step: int) -> RunShape:
        """The run shape of step ``step``: ``run`` under the drift's multipliers there."""
        if not self.drift.points:
            return self.run
        k, r = self.drift.at(self.step_frac(step)), self.run
        return dataclasses.replace(r, calls=_scaled_dist(r.calls, k.calls, k.tail),
                                   output_tokens=_scaled_dist(r.output_tokens, k.tokens),
                                   tool_s=_scaled_dist(r.tool_s, k.tool_time))

    @property
    def core_cells(self) -> int:
        """Cells that always train: the configured core group, else the fewest that hold
        the training state."""
        return self.fleet.core_cells or self.train.min_replicas()

    def async_split(self) -> int:
        """Train cells of the async baseline: the configured split, never a derived one."""
        if self.fleet.async_train_cells < 1:
            raise WorkloadError("fleet.async_train_cells=0: the async split is an explicit input; set it "
                                "(e.g. --set fleet.async_train_cells=2); --tune-async also reports the fastest split")
        short = self.train.memory_shortfall(self.fleet.async_train_cells)
        if short:
            raise WorkloadError(f"fleet.async_train_cells={self.fleet.async_train_cells} refused: {short}")
        return self.fleet.async_train_cells


# The one figure of the paper preset fitted, to the paper's colocate hours only
# (gyre_hpc.sim.calibrate.fit with gyre_hpc.sim.priors.PAPER_FITTED): the training rate per
# cell, inside its prior (1,500-3,200 tok/s, 16-35% MFU); every other figure is a physical
# prior documented in docs/sim.md. The prefill's attention cost is not fitted: it moves
# colocate only 82-85 h across its prior, so no value of it reaches the paper's hours once
# engines a flip opens share the waiting calls (docs/sim.md, "Why the training rate is the
# fitted figure"); it takes its derivation's value, 27,000 (MLA's attention FLOPs equal the
# linear FLOPs there).
PAPER_TRAIN_TOKENS_PER_S = 1945.0
PAPER_PREFILL_CTX_TOKENS = 27_000.0

PRESETS: dict[str, Workload] = {
    # Small and fast: tests, the committed sample run, the notebooks.
    "tiny": Workload(fleet=Fleet(async_train_cells=2)),
    # The paper's regime: a 2.4T-parameter MoE on H800 GPUs, cells of 8 nodes (64 GPUs).
    # docs/sim.md gives the source or reasoning of every figure; the one marked "fitted"
    # was fitted so colocate matches the paper's hours, and nothing else was.
    "paper": Workload(
        name="paper", steps=48, seed=0, decision_interval_s=60.0, engine_sample_s=300.0,
        run=RunShape(
            tasks_per_step=32, runs_per_task=8,
            calls=Dist(median=120, sigma=0.5, cap=300),
            output_tokens=Dist(median=300, sigma=0.6),
            context_tokens=Dist(median=4000, sigma=0.6),
            tool_s=Dist(median=5.0, sigma=1.0),
            timeout_s=4 * 3600.0, coarsen=16),
        engine=EngineModel(single_seq_tokens_per_s=100.0, half_saturation_seqs=256.0,
                           max_seqs=256, prefill_tokens_per_s=127_000.0, prefill_ctx_tokens=PAPER_PREFILL_CTX_TOKENS,
                           tolerated_slowdown=0.1, gpus=64, gpu_memory_gb=80.0, weights_gb=2400.0,
                           memory_utilization=0.9, kv_bytes_per_token=104e3, gpu_bandwidth_gb_s=3350.0,
                           attention_gpus=8),
        train=TrainModel(tokens_per_s=PAPER_TRAIN_TOKENS_PER_S, dp_sync_overhead=0.1, optimizer_step_s=60.0,
                         weight_sync_s=30.0, params=2.4e12, state_bytes_per_param=12.0, memory_gb=64 * 80.0, memory_utilization=0.9),
        fleet=Fleet(cells=32, rollout_to_train_s=8.5, train_to_rollout_s=3.5, async_train_cells=8,
                    async_max_staleness=1),
    ),
    # The paper's regime at local scale (examples/paper-local.yaml, paced cells): 8 cells of the
    # ``paper-local`` device (gyre_hpc.devices.presets), the easy-3turn suite's runs (three
    # calls, a lognormal environment wait after each tool call). Its run shape is what the
    # suite's runs measure (sim.measure on a paced run); docs/sim.md "paper-local" derives the
    # rates from the paper preset's dimensionless shape (sim.shape).
    "paper-local": Workload(
        name="paper-local", steps=3, seed=0, decision_interval_s=0.25, engine_sample_s=2.0,
        # The runtime's tail (rl.cluster_view ranks this share of the open runs).
        tail_fraction=TAIL_FRACTION,
        run=RunShape(
            # 12 groups of 4, as examples/paper-local.yaml runs them.
            tasks_per_step=12, runs_per_task=4,
            calls=Dist(kind="fixed", median=3),
            output_tokens=Dist(median=24, sigma=0.15, cap=24),
            context_tokens=Dist(median=50, sigma=0.05),
            # rollout.tool_latency_s 1.5 (sigma 1.0) after each tool call, with the run's
            # scoring and the harness's own time folded in: as a paced run measures it.
            tool_s=Dist(median=2.2, sigma=0.83),
            timeout_s=120.0),
        engine=device_preset("paper-local")[0],
        train=device_preset("paper-local")[1],
        fleet=Fleet(cells=8, core_cells=1, rollout_to_train_s=3.0, train_to_rollout_s=0.05, async_train_cells=2,
                    async_max_staleness=1),
    ),
}


def preset(name: str) -> Workload:
    if name not in PRESETS:
        raise WorkloadError(f"unknown workload preset {name!r}; valid presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def override(base: Any, data: dict[str, Any], where: str = "workload") -> Any:
    """``base`` (a dataclass) with the fields in ``data`` replaced, recursively, by section."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: expected a mapping of fields, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(base)}
    declared = typing.get_type_hints(type(base))
    changes: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{where}.{key}"
        if key not in fields:
            raise WorkloadError(f"{name}: unknown key; valid keys here: {', '.join(sorted(fields))}")
        current, kind = getattr(base, key), declared[key]
        if dataclasses.is_dataclass(current):
            changes[key] = override(current, value, name)
        elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            changes[key] = float(value)
        elif kind is int and isinstance(value, int) and not isinstance(value, bool):
            changes[key] = value
        elif kind is str and isinstance(value, str):
            changes[key] = value
        elif kind not in (int, float, str):
            changes[key] = value  # a Literal: its dataclass checks the value and names the choices
        else:
            raise WorkloadError(f"{name}: expected {kind.__name__}, got {value!r}")
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as exc:   # WorkloadError, DeviceError, a policy's own checks
        raise WorkloadError(f"{where}: {exc}") from None


def load_workload(path: str | Path | None = None, preset_name: str = "tiny",
                  overrides: dict[str, Any] | None = None) -> Workload:
    """A preset, then the YAML file's fields (it may name its own ``preset``), then ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        data = dict(read_yaml_mapping(path, "workload file", WorkloadError))
        preset_name = data.pop("preset", preset_name)
    try:
        w = override(preset(preset_name), data)
        return override(w, overrides or {})
    except WorkloadError as exc:
        raise WorkloadError(f"{path}: {exc}" if path is not None else str(exc)) from None


def to_dict(w: Workload) -> dict[str, Any]:
    return dataclasses.asdict(w)

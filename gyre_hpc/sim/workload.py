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
        if self.max_concurrent_runs < 0:
            raise WorkloadError(f"run.max_concurrent_runs={self.max_concurrent_runs}: must be >= 0 (0 = a batch)")

    @property
    def runs_per_step(self) -> int:
        return self.tasks_per_step * self.runs_per_task


@dataclass(frozen=True)
class EngineModel:
    """Decode speed under batching: each of ``n`` sequences decodes at
    ``single_seq_tokens_per_s * (1 + half_saturation_seqs) / (n + half_saturation_seqs)``,
    so throughput rises with ``n`` and saturates at ``single * (1 + half)``."""
    single_seq_tokens_per_s: float = 50.0
    half_saturation_seqs: float = 16.0
    max_seqs: int = 64                   # KV memory: requests beyond this wait in the queue
    prefill_tokens_per_s: float = 5000.0  # new context tokens ingested per second
    tolerated_slowdown: float = 0.1      # sizes the elastic target: per-sequence speed may drop this much
    # Context length at which decoding a token takes twice as long as at short context
    # (reading the KV cache costs as much as the rest of a decode step). 0: no dependence.
    decode_ctx_tokens: float = 0.0
    # KV capacity, as vLLM sizes it: (memory_gb x memory_utilization - weights_gb) of the
    # cell's GPU memory holds KV at kv_bytes_per_token. 0 in any of them: unchecked.
    memory_gb: float = 0.0
    weights_gb: float = 0.0
    memory_utilization: float = 0.9
    kv_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.single_seq_tokens_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise WorkloadError("engine.single_seq_tokens_per_s and engine.prefill_tokens_per_s must be > 0")
        if self.half_saturation_seqs < 0 or self.max_seqs < 1:
            raise WorkloadError("engine.half_saturation_seqs must be >= 0 and engine.max_seqs >= 1")
        if not 0 < self.tolerated_slowdown < 1:
            raise WorkloadError(f"engine.tolerated_slowdown={self.tolerated_slowdown}: must be in (0, 1)")
        if min(self.decode_ctx_tokens, self.memory_gb, self.weights_gb, self.kv_bytes_per_token) < 0:
            raise WorkloadError("engine.decode_ctx_tokens, memory_gb, weights_gb, kv_bytes_per_token must be >= 0")
        if not 0 < self.memory_utilization <= 1:
            raise WorkloadError(f"engine.memory_utilization={self.memory_utilization}: must be in (0, 1]")
        if self.memory_gb and self.kv_bytes_per_token and self.kv_capacity_tokens() <= 0:
            raise WorkloadError(f"engine.weights_gb={self.weights_gb} leaves no KV memory of "
                                f"memory_gb={self.memory_gb} x memory_utilization={self.memory_utilization}")

    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens one engine holds; 0 = not modelled (admission by slots only)."""
        if not (self.memory_gb and self.kv_bytes_per_token):
            return 0
        return int((self.memory_gb * self.memory_utilization - self.weights_gb) * 1e9 / self.kv_bytes_per_token)

    def decode_slowdown(self, ctx):
        """Decode time per token at context ``ctx`` over that at short context (scalar or array)."""
        return 1.0 + ctx / self.decode_ctx_tokens if self.decode_ctx_tokens else 1.0 + 0.0 * ctx

    def per_seq_tokens_per_s(self, n: int) -> float:
        h = self.half_saturation_seqs
        return self.single_seq_tokens_per_s * (1.0 + h) / (max(n, 1) + h)

    def target_seqs(self) -> int:
        """Largest batch whose per-sequence speed is within ``tolerated_slowdown`` of batch 1."""
        h = self.half_saturation_seqs
        n = math.floor((1.0 + h) / (1.0 - self.tolerated_slowdown) - h + 1e-9)
        return max(1, min(n, self.max_seqs))


@dataclass(frozen=True)
class TrainModel:
    tokens_per_s: float = 2000.0     # one replica (cell), trajectory tokens incl. context
    dp_sync_overhead: float = 0.1    # fraction of replica time spent in gradient all-reduce when > 1 replica
    optimizer_step_s: float = 5.0    # end of step: optimizer update, checkpoint marker
    weight_sync_s: float = 2.0       # engines load new weights before a new batch

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0:
            raise WorkloadError(f"train.tokens_per_s={self.tokens_per_s}: must be > 0")
        if not 0 <= self.dp_sync_overhead < 1:
            raise WorkloadError(f"train.dp_sync_overhead={self.dp_sync_overhead}: must be in [0, 1)")
        if self.optimizer_step_s < 0 or self.weight_sync_s < 0:
            raise WorkloadError("train.optimizer_step_s and train.weight_sync_s must be >= 0")


@dataclass(frozen=True)
class Fleet:
    cells: int = 6                          # core cell included; the same GPU budget for every policy
    rollout_only: int = 0                   # cells that never train
    rollout_to_train_s: float = 8.5         # switch costs
    train_to_rollout_s: float = 3.5
    # The async baseline's fixed split (train cells, core included): an explicit input, as
    # a user configures scheduler.async_train_cells. 0: none given (async cannot run;
    # `gyre-hpc sim --tune-async` finds the best split by simulation).
    async_train_cells: int = 0
    async_max_staleness: int = 1

    def __post_init__(self) -> None:
        if self.cells < 2:
            raise WorkloadError(f"fleet.cells={self.cells}: need >= 2 (the core cell and an engine)")
        if not 0 <= self.rollout_only <= self.cells - 1:
            raise WorkloadError(f"fleet.rollout_only={self.rollout_only}: must be in 0..{self.cells - 1}")
        if self.rollout_to_train_s < 0 or self.train_to_rollout_s < 0:
            raise WorkloadError("fleet switch costs must be >= 0")
        if self.async_train_cells < 0 or self.async_train_cells > self.cells - 1:
            raise WorkloadError(f"fleet.async_train_cells={self.async_train_cells}: must be in 0..{self.cells - 1}")
        if self.async_max_staleness < 0:
            raise WorkloadError(f"fleet.async_max_staleness={self.async_max_staleness}: must be >= 0")


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

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise WorkloadError(f"steps={self.steps}: must be >= 1")
        if self.decision_interval_s <= 0 or self.engine_sample_s <= 0:
            raise WorkloadError("decision_interval_s and engine_sample_s must be > 0")
        if not 0 < self.tail_fraction <= 1:
            raise WorkloadError(f"tail_fraction={self.tail_fraction}: must be in (0, 1]")

    def async_split(self) -> int:
        """Train cells of the async baseline: the configured split, never a derived one."""
        if self.fleet.async_train_cells < 1:
            raise WorkloadError("fleet.async_train_cells=0: the async split is an explicit input; set it "
                                "(e.g. --set fleet.async_train_cells=2); --tune-async also reports the fastest split")
        return self.fleet.async_train_cells


# The two figures of the paper preset fitted to the paper's baselines (async and colocate
# hours) by gyre_hpc.sim.calibrate.fit; see docs/sim.md for the priors they started from.
PAPER_DECODE_TOKENS_PER_S = 118.8
PAPER_TRAIN_TOKENS_PER_S = 2427.0

PRESETS: dict[str, Workload] = {
    # Small and fast: tests, the committed sample run, the notebooks.
    "tiny": Workload(fleet=Fleet(async_train_cells=2)),
    # The paper's regime: a 2.4T-parameter MoE on H800 GPUs, cells of 8 nodes (64 GPUs).
    # docs/sim.md gives the source or reasoning of every figure; the two marked "fitted"
    # were fitted so async and colocate match the paper's hours, and nothing else was.
    "paper": Workload(
        name="paper", steps=48, seed=0, decision_interval_s=60.0, engine_sample_s=300.0,
        run=RunShape(
            tasks_per_step=32, runs_per_task=8,
            calls=Dist(median=120, sigma=0.5, cap=300),
            output_tokens=Dist(median=300, sigma=0.6),
            context_tokens=Dist(median=4000, sigma=0.6),
            tool_s=Dist(median=5.0, sigma=1.0),
            timeout_s=4 * 3600.0, coarsen=16),
        engine=EngineModel(single_seq_tokens_per_s=PAPER_DECODE_TOKENS_PER_S, half_saturation_seqs=256.0,
                           max_seqs=256, prefill_tokens_per_s=60000.0, tolerated_slowdown=0.1,
                           decode_ctx_tokens=1.0e6, memory_gb=64 * 80.0, weights_gb=2400.0,
                           memory_utilization=0.9, kv_bytes_per_token=104e3),
        train=TrainModel(tokens_per_s=PAPER_TRAIN_TOKENS_PER_S, dp_sync_overhead=0.1, optimizer_step_s=60.0,
                         weight_sync_s=30.0),
        fleet=Fleet(cells=32, rollout_to_train_s=8.5, train_to_rollout_s=3.5, async_train_cells=8,
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
    except WorkloadError as exc:
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

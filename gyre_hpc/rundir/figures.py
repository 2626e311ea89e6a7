"""The analysis figures, one function each: the notebooks and ``gyre-hpc report`` draw with these.

Each takes loaded runs (``rundir.load.open_run``/``open_runs``: name -> Run, one line or
Gantt row group per run) and returns a matplotlib Figure; saving, printing and layout of a
page are the caller's. matplotlib runs headless (Agg) wherever this module is imported.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from gyre_hpc.rundir.load import Run, open_trees, role_intervals, run_span, time_fractions, tree_savings  # noqa: E402

COLORS = {"ROLLOUT": "tab:blue", "TRAIN": "tab:orange", "SWITCH": "tab:red", "idle": "lightgray"}


def gantt(runs: dict[str, Run]) -> Figure:
    """Cell roles over time, one row per cell, with step boundaries and KV moves marked."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.2 * len(runs)), squeeze=False, sharex=True)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        iv = role_intervals(run)
        t0, _ = run_span(run)  # real runs record epoch times, simulated ones start at 0
        for state, color in COLORS.items():
            sel = iv["state"].values == state
            for c in np.unique(iv["cell"].values[sel]):
                rows = sel & (iv["cell"].values == c)
                spans = list(zip(iv["start"].values[rows] - t0, (iv["end"] - iv["start"]).values[rows]))
                ax.broken_barh(spans, (c - 0.4, 0.8), color=color)
        for t in run.steps["time"].values:
            ax.axvline(t - t0, color="k", lw=0.5, ls=":")
        moves = run.timeline["event"].values == "migrate"
        ax.plot(run.timeline["time"].values[moves] - t0, run.timeline["cell"].values[moves], "kx", ms=7)
        ax.set_ylabel(f"{name}\ncell")
    axes[0, 0].legend(handles=[Patch(color=COLORS["ROLLOUT"], label="ROLLOUT"),
                               Patch(color=COLORS["TRAIN"], label="TRAIN"),
                               Patch(color=COLORS["SWITCH"], label="switching"),
                               Line2D([], [], color="k", ls=":", lw=0.8, label="step boundary"),
                               Line2D([], [], color="k", marker="x", ls="", label="KV moved")],
                      loc="upper right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    return fig


def busy(runs: dict[str, Run]) -> Figure:
    """Share of all cell-seconds rolling out, training, switching or idle, per run."""
    fractions = {name: time_fractions(run) for name, run in runs.items()}
    fig, ax = plt.subplots(figsize=(6, 3.5))
    bottom = np.zeros(len(fractions))
    for key, color in zip(("rollout", "train", "switch", "idle"),
                          (COLORS["ROLLOUT"], COLORS["TRAIN"], COLORS["SWITCH"], COLORS["idle"])):
        vals = np.array([fractions[n][key] for n in fractions])
        ax.bar(list(fractions), vals, bottom=bottom, color=color, label=key)
        bottom += vals
    ax.set_ylabel("fraction of cell-time")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def step_times(runs: dict[str, Run]) -> Figure:
    """Wall time of every RL step, per run."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, run in runs.items():
        ax.plot(run.steps["step"].values, run.steps["wall_s"].values / 60, marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("step wall time (min)")
    ax.legend()
    fig.tight_layout()
    return fig


def reward_curves(runs: dict[str, Run], trees_run: Path | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Mean reward per step: ``metrics.h5``'s where a run recorded rewards, and the checker
    scores of ``trees_run``'s ``trees.zarr`` by policy version."""
    curves = {name: (run.steps["step"].values, run.steps["reward_mean"].values) for name, run in runs.items()
              if np.isfinite(run.steps["reward_mean"].values).any()}
    if trees_run is not None and (Path(trees_run) / "trees.zarr").exists():
        trees = open_trees(Path(trees_run) / "trees.zarr")
        version, reward = trees["policy_version"].values, trees["reward"].values
        steps = np.unique(version)
        curves[f"{Path(trees_run).name} (trees)"] = (steps, np.array([reward[version == s].mean() for s in steps]))
    return curves


def rewards(curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> Figure:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, (x, y) in curves.items():
        ax.plot(x, y, marker="o", label=name)
    ax.set_xlabel("RL step (policy version)")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    if curves:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no rewards recorded", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def savings(trees) -> Figure:
    """Tokens each tree stores against its calls as separate sequences, and their ratio."""
    sav = tree_savings(trees)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    idx = np.arange(sav.sizes["tree"])
    a.bar(idx - 0.2, sav["unpacked_tokens"].values, width=0.4, label="calls as separate sequences")
    a.bar(idx + 0.2, sav["tree_tokens"].values, width=0.4, label="tree")
    a.set_xlabel("tree")
    a.set_ylabel("tokens")
    a.legend()
    b.hist(sav["savings"].values, bins=10)
    b.set_xlabel("unpacked / tree tokens")
    b.set_ylabel("trees")
    fig.tight_layout()
    return fig

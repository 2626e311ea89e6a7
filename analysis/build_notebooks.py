"""Writes the analysis notebooks (``python analysis/build_notebooks.py``).

The notebooks are generated so their code stays reviewable as Python here, and so every
notebook shares one setup cell: where the runs are (``GYRE_RUNS``, one run directory per
policy, e.g. ``gyre-hpc sim --out``), where a run with ``trees.zarr`` is
(``GYRE_TREES_RUN``), the sweep JSON (``GYRE_SWEEP``), and where figures go
(``GYRE_FIGURES``, default ``analysis/figures/``). With nothing set, a small sample is made
once under ``runs/analysis-sample`` (tiny simulated runs, a tiny sweep, synthetic trees).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = '''\
import json, os, pathlib
import matplotlib
matplotlib.use("Agg")  # headless: figures are written as PNG files
import matplotlib.pyplot as plt
import numpy as np
from gyre_hpc.rundir.load import open_run, open_runs, role_intervals, run_span, time_fractions, tree_savings

SAMPLE = pathlib.Path(os.environ.get("GYRE_SAMPLE", "../runs/analysis-sample"))
if not all(os.environ.get(k) for k in ("GYRE_RUNS", "GYRE_TREES_RUN", "GYRE_SWEEP")) and not SAMPLE.exists():
    from gyre_hpc.sim.sample import make_sample
    make_sample(SAMPLE)
RUNS = pathlib.Path(os.environ.get("GYRE_RUNS", SAMPLE / "runs"))
TREES_RUN = pathlib.Path(os.environ.get("GYRE_TREES_RUN", SAMPLE / "synthetic_trees"))
SWEEP = pathlib.Path(os.environ.get("GYRE_SWEEP", SAMPLE / "sweep.json"))
FIGURES = pathlib.Path(os.environ.get("GYRE_FIGURES", "figures"))
FIGURES.mkdir(parents=True, exist_ok=True)
COLORS = {"ROLLOUT": "tab:blue", "TRAIN": "tab:orange", "SWITCH": "tab:red", "idle": "lightgray"}
'''

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "timeline.ipynb": [
        ("md", "# Cell roles over time\nOne Gantt row per cell: blue rolls out (ROLLOUT), orange trains "
               "(TRAIN), red is switching. Dotted lines are step boundaries; black crosses mark a KV "
               "migration (a released engine's in-flight requests moving to the engines that stay)."),
        ("code", SETUP),
        ("code", '''\
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

runs = open_runs(RUNS)
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
    ax.set_ylabel(f"{name}\\ncell")
axes[0, 0].legend(handles=[Patch(color=COLORS["ROLLOUT"], label="ROLLOUT"), Patch(color=COLORS["TRAIN"], label="TRAIN"),
                           Patch(color=COLORS["SWITCH"], label="switching"),
                           Line2D([], [], color="k", ls=":", lw=0.8, label="step boundary"),
                           Line2D([], [], color="k", marker="x", ls="", label="KV migration")],
                  loc="upper right", fontsize=7, ncol=5)
axes[-1, 0].set_xlabel("time since start (s)")
fig.tight_layout()
fig.savefig(FIGURES / "gantt.png", dpi=80)
'''),
        ("md", "## Per-cell busy fractions\nShare of each cell's time in each state (from the timeline), and "
               "the KV each released engine moved (requests mid-decode and retained contexts)."),
        ("code", '''\
for name, run in runs.items():
    iv = role_intervals(run)
    dur = iv["end"].values - iv["start"].values
    moves = run.timeline["event"].values == "migrate"
    for c in np.unique(iv["cell"].values):
        mine = iv["cell"].values == c
        total = dur[mine].sum()
        shares = {s: round(float(dur[mine & (iv["state"].values == s)].sum() / total), 3) if total > 0 else float("nan")
                  for s in ("ROLLOUT", "TRAIN", "SWITCH")}
        print(name, f"cell {int(c)}", shares, "migrations:", int((run.timeline["cell"].values[moves] == c).sum()))
'''),
        ("code", '''\
print({name: int(run.timeline.sizes["row"]) for name, run in runs.items()})'''),
    ],
    "utilisation.ipynb": [
        ("md", "# Where the cell-time goes\nShare of all cell-seconds spent rolling out, training, switching, or idle, per policy."),
        ("code", SETUP),
        ("code", '''\
runs = open_runs(RUNS)
fractions = {name: time_fractions(run) for name, run in runs.items()}
keys = ["rollout", "train", "switch", "idle"]
colors = [COLORS["ROLLOUT"], COLORS["TRAIN"], COLORS["SWITCH"], COLORS["idle"]]
fig, ax = plt.subplots(figsize=(6, 3.5))
bottom = np.zeros(len(fractions))
for key, color in zip(keys, colors):
    vals = np.array([fractions[n][key] for n in fractions])
    ax.bar(list(fractions), vals, bottom=bottom, color=color, label=key)
    bottom += vals
ax.set_ylabel("fraction of cell-time")
ax.legend(loc="upper left", bbox_to_anchor=(1, 1))
fig.tight_layout()
fig.savefig(FIGURES / "busy.png", dpi=80)
for name, f in fractions.items():
    print(name, {k: round(float(v), 3) for k, v in f.items()})'''),
    ],
    "steps.ipynb": [
        ("md", "# Step times and rewards\nWall time of every RL step per policy; the reward curve from `metrics.h5` "
               "where the run recorded rewards, else from the checker scores in `trees.zarr`."),
        ("code", SETUP),
        ("code", '''\
runs = open_runs(RUNS)
fig, ax = plt.subplots(figsize=(6, 3.5))
for name, run in runs.items():
    ax.plot(run.steps["step"].values, run.steps["wall_s"].values / 60, marker="o", label=name)
ax.set_xlabel("RL step"); ax.set_ylabel("step wall time (min)"); ax.legend()
fig.tight_layout()
fig.savefig(FIGURES / "step_times.png", dpi=80)
print({name: round(float(run.steps["wall_s"].sum()) / 3600, 3) for name, run in runs.items()}, "hours")'''),
        ("code", '''\
fig, ax = plt.subplots(figsize=(6, 3.5))
curves = {name: (run.steps["step"].values, run.steps["reward_mean"].values) for name, run in runs.items()
          if np.isfinite(run.steps["reward_mean"].values).any()}
if TREES_RUN.exists() and (TREES_RUN / "trees.zarr").exists():
    from gyre_hpc.rundir.load import open_trees
    trees = open_trees(TREES_RUN / "trees.zarr")
    version, reward = trees["policy_version"].values, trees["reward"].values
    steps = np.unique(version)
    curves[f"{TREES_RUN.name} (trees)"] = (steps, np.array([reward[version == s].mean() for s in steps]))
for name, (x, y) in curves.items():
    ax.plot(x, y, marker="o", label=name)
ax.set_xlabel("RL step (policy version)"); ax.set_ylabel("mean reward"); ax.set_ylim(-0.05, 1.05)
if curves:
    ax.legend()
else:
    ax.text(0.5, 0.5, "no rewards recorded", ha="center", transform=ax.transAxes)
fig.tight_layout()
fig.savefig(FIGURES / "rewards.png", dpi=80)
print({k: np.round(v[1], 3).tolist() for k, v in curves.items()})'''),
    ],
    "trees.ipynb": [
        ("md", "# Token savings of trajectory trees\nTokens stored once in each run's tree against the tokens "
               "its calls would take as separate sequences (each call's whole context)."),
        ("code", SETUP),
        ("code", '''\
from gyre_hpc.rundir.load import open_trees
trees = open_trees(TREES_RUN / "trees.zarr")
sav = tree_savings(trees)
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
idx = np.arange(sav.sizes["tree"])
a.bar(idx - 0.2, sav["unpacked_tokens"].values, width=0.4, label="calls as separate sequences")
a.bar(idx + 0.2, sav["tree_tokens"].values, width=0.4, label="tree")
a.set_xlabel("tree"); a.set_ylabel("tokens"); a.legend()
b.hist(sav["savings"].values, bins=10)
b.set_xlabel("unpacked / tree tokens"); b.set_ylabel("trees")
fig.tight_layout()
fig.savefig(FIGURES / "tree_savings.png", dpi=80)
total = float(sav["unpacked_tokens"].sum() / sav["tree_tokens"].sum())
print(f"{sav.sizes['tree']} trees, {int(sav['tree_tokens'].sum())} tree tokens, {total:.2f}x fewer than unpacked")'''),
    ],
    "sweep.ipynb": [
        ("md", "# Where elastic wins and where it loses\n`gyre-hpc sim --sweep --json`: elastic's speedup over "
               "async at its typical (configured) split, async at its tuned split, and colocate, as one knob "
               "moves (training cost, tail heaviness, cell count, switch cost); below the dashed line elastic "
               "is slower."),
        ("code", SETUP),
        ("code", '''\
sweep = json.loads(SWEEP.read_text())
knobs = list(dict.fromkeys(r["knob"] for r in sweep["rows"]))
fig, axes = plt.subplots(1, len(knobs), figsize=(3.2 * len(knobs), 3), squeeze=False, sharey=True)
labels = {"async": f"vs async ({sweep['async_train_cells']} of {sweep['cells']} train)",
          "async_tuned": "vs async, tuned split", "colocate": "vs colocate"}
for ax, knob in zip(axes[0], knobs):
    rows = [r for r in sweep["rows"] if r["knob"] == knob]
    x = [r["value"] for r in rows]
    for base, label in labels.items():
        ax.plot(x, [r[f"elastic_over_{base}"] for r in rows], marker="o", label=label)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set_title(knob); ax.set_xlabel(knob)
    if knob in ("switch_cost_x", "cells", "train_cost_x"):  # multiplicative knobs
        ax.set_xscale("log" if min(x) > 0 else "symlog", **({} if min(x) > 0 else {"linthresh": 1}))
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.minorticks_off()
axes[0, 0].set_ylabel("elastic speedup"); axes[0, 0].legend(fontsize=7)
fig.tight_layout()
fig.savefig(FIGURES / "sweep.png", dpi=80)
print(sweep["elastic_slower_than"])'''),
    ],
}


def build(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in cells])
        for i, cell in enumerate(nb.cells):
            cell.id = f"{Path(name).stem}-{i}"  # stable ids: rebuilding an unchanged notebook changes nothing
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = out_dir / name
        nbformat.write(nb, path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build():
        print(p)

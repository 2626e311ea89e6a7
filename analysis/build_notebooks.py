"""Writes the analysis notebooks (``python analysis/build_notebooks.py``).

The notebooks are generated so their code stays reviewable as Python here, and so every
notebook shares one setup cell: where the runs are (``GYRE_RUNS``, one run directory per
policy, e.g. ``gyre-hpc sim --out``), where a run with ``trees.zarr`` is
(``GYRE_TREES_RUN``), the sweep and sensitivity JSON (``GYRE_SWEEP``,
``GYRE_SENSITIVITY``: ``gyre-hpc sim --sensitivity --json``), and where figures go
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
from gyre_hpc.rundir import figures  # the figures themselves; gyre-hpc report draws the same
from gyre_hpc.rundir.load import open_run, open_runs, role_intervals, run_span, time_fractions, tree_savings

SAMPLE = pathlib.Path(os.environ.get("GYRE_SAMPLE", "../runs/analysis-sample"))
if not all(os.environ.get(k) for k in ("GYRE_RUNS", "GYRE_TREES_RUN", "GYRE_SWEEP")) and not SAMPLE.exists():
    from gyre_hpc.sim.sample import make_sample
    make_sample(SAMPLE)
RUNS = pathlib.Path(os.environ.get("GYRE_RUNS", SAMPLE / "runs"))
TREES_RUN = pathlib.Path(os.environ.get("GYRE_TREES_RUN", SAMPLE / "synthetic_trees"))
SWEEP = pathlib.Path(os.environ.get("GYRE_SWEEP", SAMPLE / "sweep.json"))
SENSITIVITY = pathlib.Path(os.environ.get("GYRE_SENSITIVITY", SAMPLE / "sensitivity.json"))
FIGURES = pathlib.Path(os.environ.get("GYRE_FIGURES", "figures"))
FIGURES.mkdir(parents=True, exist_ok=True)
'''

NOTEBOOKS: dict[str, list[tuple[str, str]]] = {
    "timeline.ipynb": [
        ("md", "# Cell roles over time\nOne Gantt row per cell: blue rolls out (ROLLOUT), orange trains "
               "(TRAIN), red is switching. Dotted lines are step boundaries; black crosses mark a KV "
               "migration (a released engine's in-flight requests moving to the engines that stay)."),
        ("code", SETUP),
        ("code", '''\
runs = open_runs(RUNS)
figures.gantt(runs).savefig(FIGURES / "gantt.png", dpi=80)
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
        ("md", "## A paced run beside the simulator\nWith `GYRE_PACED_RUN` set to a paced run "
               "(`cells.device: paced`, e.g. `DIR/elastic-0` of `gyre-hpc bench e2e --regime paper-local "
               "--out DIR`): its Gantt, whose durations are EMULATED, above the simulator's of the same "
               "regime, scheduler and measured run shape (`gyre_hpc.bench.regime.simulated_twin`)."),
        ("code", '''\
paced = os.environ.get("GYRE_PACED_RUN")
if paced:
    import tempfile
    from gyre_hpc.bench.regime import simulated_twin
    twin = simulated_twin(paced, pathlib.Path(tempfile.mkdtemp(prefix="gyre-twin-")) / "sim")
    pair = {"paced run (EMULATED durations)": open_run(paced), "simulator, same regime": open_run(twin)}
    figures.gantt(pair).savefig(FIGURES / "gantt_paced_vs_sim.png", dpi=80)
    print({k: [round(float(x), 1) for x in r.steps["wall_s"].values] for k, r in pair.items()})
else:
    print("GYRE_PACED_RUN is not set: no paced run to draw beside the simulator")'''),
    ],
    "utilisation.ipynb": [
        ("md", "# Where the cell-time goes\nShare of all cell-seconds spent rolling out, training, switching, or idle, per policy."),
        ("code", SETUP),
        ("code", '''\
runs = open_runs(RUNS)
figures.busy(runs).savefig(FIGURES / "busy.png", dpi=80)
fractions = {name: time_fractions(run) for name, run in runs.items()}
for name, f in fractions.items():
    print(name, {k: round(float(v), 3) for k, v in f.items()})'''),
    ],
    "steps.ipynb": [
        ("md", "# Step times and rewards\nWall time of every RL step per policy; the reward curve from `metrics.h5` "
               "where the run recorded rewards, else from the checker scores in `trees.zarr`."),
        ("code", SETUP),
        ("code", '''\
runs = open_runs(RUNS)
figures.step_times(runs).savefig(FIGURES / "step_times.png", dpi=80)
print({name: round(float(run.steps["wall_s"].sum()) / 3600, 3) for name, run in runs.items()}, "hours")'''),
        ("code", '''\
curves = figures.reward_curves(runs, TREES_RUN)
figures.rewards(curves).savefig(FIGURES / "rewards.png", dpi=80)
print({k: np.round(v[1], 3).tolist() for k, v in curves.items()})'''),
    ],
    "trees.ipynb": [
        ("md", "# Token savings of trajectory trees\nTokens stored once in each run's tree against the tokens "
               "its calls would take as separate sequences (each call's whole context)."),
        ("code", SETUP),
        ("code", '''\
from gyre_hpc.rundir.load import open_trees
trees = open_trees(TREES_RUN / "trees.zarr")
figures.savings(trees).savefig(FIGURES / "tree_savings.png", dpi=80)
sav = tree_savings(trees)
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
        ("md", "## The band across the priors\n`gyre-hpc sim --sensitivity --json`: every prior at each end of its "
               "range, several seeds, the fitted figure refit each time. Each dot is one variant's ratio (right of "
               "the dashed line elastic is faster); the bar spans the band."),
        ("code", '''\
sens = json.loads(SENSITIVITY.read_text())
names = sorted(sens["bands"]["ratios"])
fig, ax = plt.subplots(figsize=(7, 0.6 * len(names) + 1))
for i, name in enumerate(names):
    vals = [r["ratios"][name] for r in sens["rows"] if name in r["ratios"]]
    ax.plot(vals, [i] * len(vals), "o", alpha=0.4, ms=4)
    ax.hlines(i, min(vals), max(vals), lw=2)
ax.axvline(1.0, color="k", ls="--", lw=0.8)
ax.set_yticks(range(len(names)), names); ax.set_xlabel("speedup (baseline hours / elastic hours)")
ax.set_title(f"{sens['preset']}: {sens['variants']} variants, {sens['fitted']} refit each time", fontsize=9)
fig.tight_layout()
fig.savefig(FIGURES / "sensitivity.png", dpi=80)
print(sens["worst"], sens["dominance"])'''),
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

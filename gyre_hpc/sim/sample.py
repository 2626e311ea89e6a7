"""A small recorded sample for the analysis notebooks: tiny simulated runs of each policy,
a tiny sweep, a tiny sensitivity band, and a trees.zarr of synthetic agent journals (built and stored by the real
tree builder and store), so every notebook has something to open in seconds."""
from __future__ import annotations

import json
from pathlib import Path

from gyre_hpc.sim.compare import compare
from gyre_hpc.sim.sensitivity import sensitivity
from gyre_hpc.sim.sweep import sweep
from gyre_hpc.sim.workload import preset

SWEEP_FILE = "sweep.json"
SENSITIVITY_FILE = "sensitivity.json"
TREES_RUN = "synthetic_trees"


def make_sample(out: str | Path, steps: int = 3) -> Path:
    import dataclasses
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    w = dataclasses.replace(preset("tiny"), steps=steps)
    compare(w, out=out / "runs")
    (out / SWEEP_FILE).write_text(json.dumps(sweep(dataclasses.replace(w, steps=2)), indent=2))
    (out / SENSITIVITY_FILE).write_text(json.dumps(sensitivity(w, steps=2, seeds=(0, 1), workers=1), indent=2))
    write_synthetic_trees(out / TREES_RUN, steps)
    return out


def write_synthetic_trees(run_dir: Path, steps: int) -> None:
    """``run_dir/trees.zarr`` holding 4 synthetic runs per step (real builder, real store)."""
    from gyre_hpc.rundir.layout import RunDir
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.store import TreeStore
    from gyre_hpc.trees.synthetic import synthetic_runs
    rd = RunDir.at(run_dir)
    rd.root.mkdir(parents=True, exist_ok=True)
    if rd.trees.exists():
        import shutil
        shutil.rmtree(rd.trees)
    with TreeStore.open(rd.trees, "a", durable=False) as store:
        for step in range(steps):
            trees = [build_tree(r.journal, run_id=f"s{step}-{r.run_id}", task_id=r.task_id, reward=r.reward,
                                policy_version=step)
                     for r in synthetic_runs(n_tasks=2, runs_per_task=2, seed=step)]
            store.append(trees)

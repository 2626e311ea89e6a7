"""Open any run directory, real or simulated, as xarray Datasets for analysis notebooks.

Every ``metrics.h5`` table becomes a Dataset on one dimension (``step`` for steps,
``sample`` for engines, ``row`` for the rest); ``trees.zarr`` opens through the tree
store so only committed trees are seen, even on a live run. Reads use SWMR, so a notebook
can follow a run that is still writing.

The timeline: a row marks the state a cell *enters* at ``time`` (ROLLOUT, TRAIN, SWITCH,
or a flip row: ``flip_start`` enters the switch, ``flip_end`` its target role); a cell keeps
it until its next row; ``end`` rows close the run (see ``role_intervals``). The engines table samples every cell: ``tokens_per_s > 0`` or ``inflight > 0``
(requests decoding, or a replica's micro-batch / optimizer step in hand) means it was working.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xarray as xr

from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import TABLES, open_for_read, read_table

_DIM = {"steps": "step", "engines": "sample"}
STATES = ("ROLLOUT", "TRAIN", "SWITCH")


@dataclass
class Run:
    root: Path
    attrs: dict
    tables: dict[str, xr.Dataset]   # every metrics.h5 table, by name
    trees: xr.Dataset | None
    sim: dict | None                # sim.json of a simulated run, else None

    @property
    def timeline(self) -> xr.Dataset:
        return self.tables["timeline"]

    @property
    def steps(self) -> xr.Dataset:
        return self.tables["steps"]

    @property
    def engines(self) -> xr.Dataset:
        return self.tables["engines"]

    @property
    def events(self) -> xr.Dataset:
        return self.tables["events"]

    @property
    def runs(self) -> xr.Dataset:
        return self.tables["runs"]

    @property
    def name(self) -> str:
        return str(self.attrs.get("policy") or self.root.name)

    @property
    def simulated(self) -> bool:
        return self.attrs.get("source") == "sim"


def _table(path: Path, table: str, present: set[str]) -> xr.Dataset:
    dim = _DIM.get(table, "row")
    if table not in present:
        # A file written before this table joined the schema: the table is empty, not an error.
        return xr.Dataset({col: (dim, np.zeros(0, dtype=object if str(dt).startswith("S") else dt))
                           for col, dt in TABLES[table]})
    cols = read_table(path, table)
    ds = xr.Dataset({k: (dim, np.asarray(v)) for k, v in cols.items()})
    if table == "steps":
        ds = ds.assign_coords(step=ds["step"].values)
    return ds


def _attrs_and_tables(path: Path) -> tuple[dict, set[str]]:
    with open_for_read(path) as f:
        out = {}
        for k, v in f.attrs.items():
            out[k] = v.decode() if isinstance(v, bytes) else v.item() if hasattr(v, "item") else v
        return out, set(f.keys())


def open_trees(path: str | Path) -> xr.Dataset:
    """``trees.zarr`` as a Dataset of its committed rows."""
    from gyre_hpc.trees.store import TreeStore
    with TreeStore.open(path, "r") as store:
        return store.dataset()


def open_run(path: str | Path) -> Run:
    """One run directory; a missing directory or ``metrics.h5`` is named in the error."""
    rd = RunDir.at(path)
    if not rd.root.is_dir():
        raise FileNotFoundError(f"run directory {rd.root} does not exist")
    if not rd.metrics.is_file():
        raise FileNotFoundError(f"{rd.metrics} does not exist: not a run directory (or nothing recorded yet)")
    attrs, present = _attrs_and_tables(rd.metrics)
    tables = {t: _table(rd.metrics, t, present) for t in TABLES}
    sim_path = rd.root / "sim.json"
    return Run(
        root=rd.root, attrs=attrs, tables=tables,
        trees=open_trees(rd.trees) if rd.trees.exists() else None,
        sim=json.loads(sim_path.read_text()) if sim_path.is_file() else None)


def open_runs(parent: str | Path) -> dict[str, Run]:
    """Every run directory directly under ``parent`` (e.g. ``gyre-hpc sim --out``), by name."""
    p = Path(parent)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} does not exist")
    runs = {d.name: open_run(d) for d in sorted(p.iterdir()) if (d / "metrics.h5").is_file()}
    if not runs:
        raise FileNotFoundError(f"no run directories (with metrics.h5) under {p}")
    return runs


_SWITCH_EVENTS = ("switch", "flip_start")


def run_span(run: Run) -> tuple[float, float]:
    """First and last time anything was recorded (simulated runs start at 0, real ones at
    an epoch time); what a notebook subtracts to plot time since the start."""
    times = [run.timeline["time"].values, run.events["time"].values, run.steps["time"].values,
             run.steps["time"].values - run.steps["wall_s"].values]
    times = np.concatenate([t for t in times if t.size]) if any(t.size for t in times) else np.zeros(1)
    return float(times.min()), float(times.max())


def _initial_roles(run: Run) -> dict[int, str]:
    """Each cell's role when the fleet starts, from the run's config.yaml (core and
    cells.initial_train train, the rest roll out); empty when there is no readable config."""
    from gyre_hpc.config import ConfigError, load_config
    path = RunDir.at(run.root).config
    if not path.is_file():
        return {}
    try:
        plan = load_config(path).cells
    except ConfigError:
        return {}
    train = {plan.core, *(plan.initial_train or [])}
    return {c: "TRAIN" if c in train else "ROLLOUT" for c in range(plan.count)}


def role_intervals(run: Run) -> xr.Dataset:
    """The timeline as intervals on dim ``interval``: cell, state, start, end.

    Reads both ways a timeline is written: rows that name the state entered (``start``,
    ``switch`` with role SWITCH, ``role``, ``end``: the simulator) and flip rows whose role
    is the target (``flip_start`` = the switch begins, ``flip_end`` = the new role: the fleet
    controller). Before a cell's first row it holds its initial role: from ``config.yaml``
    where the run has one, else the opposite of its first flip's target.
    """
    tl = run.timeline
    time, cell, role, event = (tl[k].values for k in ("time", "cell", "role", "event"))
    t0, t_end = run_span(run)
    initial = _initial_roles(run)
    cells, states, starts, ends = [], [], [], []

    def add(c: int, state: str, a: float, b: float) -> None:
        if b > a:
            cells.append(int(c)); states.append(state); starts.append(float(a)); ends.append(float(b))

    for c in sorted(set(np.unique(cell).tolist()) | set(initial)):
        idx = np.flatnonzero(cell == c)
        idx = idx[np.argsort(time[idx], kind="stable")]
        if not idx.size or (event[idx[0]] != "start" and time[idx[0]] > t0):
            first = initial.get(c)
            if first is None and idx.size and role[idx[0]] in ("ROLLOUT", "TRAIN"):
                first = "TRAIN" if role[idx[0]] == "ROLLOUT" else "ROLLOUT"
            if first is not None:
                add(c, first, t0, time[idx[0]] if idx.size else t_end)
        for i, j in zip(idx, list(idx[1:]) + [None]):
            if event[i] == "end":
                continue
            state = "SWITCH" if event[i] in _SWITCH_EVENTS else str(role[i])
            if state in STATES:
                add(c, state, time[i], time[j] if j is not None else t_end)
    return xr.Dataset({"cell": ("interval", np.array(cells, dtype=int)),
                       "state": ("interval", np.array(states, dtype=object)),
                       "start": ("interval", np.array(starts)), "end": ("interval", np.array(ends))})


def time_fractions(run: Run) -> dict[str, float]:
    """Share of cell-time spent rolling out, training, switching and idle.

    Role time comes exactly from the timeline; the busy/idle split within each role from
    the engines samples (a sample with tokens/s > 0 or work in flight is busy). A role
    without samples is counted whole as that role; without any samples idle is NaN.
    """
    iv = role_intervals(run)
    dur = iv["end"].values - iv["start"].values
    total = dur.sum()
    if total <= 0:
        raise ValueError(f"{run.root}: the timeline covers no time")
    role_time = {s: dur[iv["state"].values == s].sum() for s in STATES}
    eng = run.engines
    if eng.sizes.get("sample", 0) == 0:
        return {"rollout": role_time["ROLLOUT"] / total, "train": role_time["TRAIN"] / total,
                "switch": role_time["SWITCH"] / total, "idle": float("nan")}
    states = state_at(iv, eng["cell"].values, eng["time"].values)
    busy = (eng["tokens_per_s"].values > 0) | (eng["inflight"].values > 0)
    out = {"switch": role_time["SWITCH"] / total}
    idle = 0.0
    for s, key in (("ROLLOUT", "rollout"), ("TRAIN", "train")):
        mask = states == s
        # A role nobody sampled (the RL controller samples engines only) is not split: its
        # time counts as that role's, and idle covers only what was sampled.
        share = busy[mask].mean() if mask.any() else 1.0
        out[key] = role_time[s] * share / total
        idle += role_time[s] * (1 - share) / total
    out["idle"] = idle
    return out


def state_at(iv: xr.Dataset, cells: np.ndarray, times: np.ndarray) -> np.ndarray:
    """The state (ROLLOUT/TRAIN/SWITCH, "" where unknown) of each (cell, time) pair."""
    out = np.full(len(times), "", dtype=object)
    for c in np.unique(cells):
        sel = np.flatnonzero(iv["cell"].values == c)
        starts = iv["start"].values[sel]
        order = np.argsort(starts)
        sel, starts = sel[order], starts[order]
        q = np.flatnonzero(cells == c)
        k = np.searchsorted(starts, times[q], side="right") - 1
        ok = (k >= 0) & (times[q] < iv["end"].values[sel[np.clip(k, 0, None)]])
        out[q[ok]] = iv["state"].values[sel[k[ok]]]
    return out


def tree_savings(trees: xr.Dataset) -> xr.Dataset:
    """Per tree: tokens stored once in the tree vs tokens the same calls would take as
    separate sequences (each call's full root-to-node path), and their ratio."""
    parent = trees["parent"].values.astype(np.int64)
    node_len = trees["node_len"].values.astype(np.int64)
    path_len = np.zeros(len(node_len), dtype=np.int64)
    # Nodes are stored parents-first (depth-first order), so one forward pass suffices.
    for i in range(len(node_len)):
        path_len[i] = node_len[i] + (path_len[parent[i]] if parent[i] >= 0 else 0)
    n_trees = trees.sizes["tree"]
    call_tree = trees["call_tree"].values.astype(np.int64)
    unpacked = np.bincount(call_tree, weights=path_len[trees["call_node"].values], minlength=n_trees)
    stored = trees["n_tokens"].values.astype(np.float64)
    return xr.Dataset({
        "tree_tokens": ("tree", stored), "unpacked_tokens": ("tree", unpacked),
        "savings": ("tree", np.where(stored > 0, unpacked / np.maximum(stored, 1), np.nan)),
        "policy_version": ("tree", trees["policy_version"].values),
        "reward": ("tree", trees["reward"].values)})

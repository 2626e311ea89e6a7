"""``gyre-hpc bench store``: tree store append and streaming-read throughput (tokens/s)
beside a raw ``numpy.save``/``numpy.load`` of the very same flat arrays, in one run.

The baseline is what a store without commit markers, checksums, compression or xarray
readability would cost: one ``.npy`` per array per append batch, fsynced like the store,
then loaded back and sliced into the same ``Tree`` objects. The ratios say what the
store's guarantees cost.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from gyre_hpc import fsio
from gyre_hpc.report import emit
from gyre_hpc.trees.model import ROLES, STATUSES, Tree


def random_tree(seed: int, n_nodes: int = 40, mean_node_tokens: int = 64, n_calls: int | None = None) -> Tree:
    """A random but valid tree: nodes in depth-first preorder (``parent[i] < i``, every
    subtree a contiguous token interval), calls ending at nodes, a few dropped calls.

    Deterministic in ``seed`` so a test (or another process) can rebuild what was written.
    Independent of the builder so the store is tested on shapes the builder may never make
    (empty trees, several roots, zero-length nodes).
    """
    rng = np.random.default_rng(seed)
    parent = np.empty(n_nodes, dtype=np.int32)
    stack: list[int] = []
    for i in range(n_nodes):
        # Preorder: a new node hangs off some node on the current root-to-leaf path.
        if stack and rng.random() < 0.05:
            stack.clear()                     # occasionally start another root
        if stack and rng.random() < 0.4:
            del stack[int(rng.integers(1, len(stack) + 1)):]   # climb back up the path
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    node_len = rng.integers(0, 2 * mean_node_tokens + 1, size=n_nodes).astype(np.int32)
    node_start = np.concatenate([[0], np.cumsum(node_len[:-1], dtype=np.int64)]).astype(np.int64) if n_nodes else np.zeros(0, np.int64)
    t = int(node_len.sum())
    trained = rng.random(t) < 0.4
    logprobs = np.where(trained, -rng.exponential(1.0, t), 0.0).astype(np.float32)
    c = int(rng.integers(1, max(n_nodes, 1) + 1)) if n_calls is None else n_calls
    c = min(c, n_nodes) if n_nodes else 0
    agents = ["main", "sub-1", "sub-2", "Ünïcode-agent"]
    return Tree(
        tokens=rng.integers(0, 50_000, size=t).astype(np.int32),
        logprobs=logprobs,
        trained=trained,
        node_start=node_start,
        node_len=node_len,
        parent=parent,
        node_role=rng.integers(0, len(ROLES), size=n_nodes).astype(np.int8),
        call_node=rng.integers(0, n_nodes, size=c).astype(np.int32) if c else np.zeros(0, np.int32),
        call_role=rng.integers(0, len(ROLES), size=c).astype(np.int8),
        call_agent=[agents[int(x)] for x in rng.integers(0, len(agents), size=c)],
        run_id=f"run-{seed:06d}",
        task_id=f"task-{seed % 7}",
        reward=float(rng.random()),
        status=STATUSES[int(rng.integers(0, len(STATUSES)))],
        policy_version=int(rng.integers(0, 100)),
        wall_s=float(rng.random() * 1000),
        dropped_calls=sorted(int(x) for x in rng.choice(200, size=int(rng.integers(0, 4)), replace=False)),
    )


def synthetic_trees(n_runs: int, seed: int = 0) -> list[Tree]:
    """The realistic workload: synthetic long-horizon journals through the real builder."""
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.synthetic import synthetic_runs

    runs_per_task = 8
    runs = synthetic_runs(n_tasks=-(-n_runs // runs_per_task), runs_per_task=runs_per_task, seed=seed)[:n_runs]
    return [build_tree(r.journal, run_id=r.run_id, task_id=r.task_id, reward=r.reward) for r in runs]


def _store_append(path: Path, batches: list[list[Tree]], durable: bool) -> float:
    from gyre_hpc.trees.store import TreeStore

    t0 = time.perf_counter()
    store = TreeStore.open(path, "a", durable=durable)
    for batch in batches:
        store.append(batch)
    store.close()
    return time.perf_counter() - t0


def _store_stream(path: Path) -> tuple[float, list[Tree]]:
    from gyre_hpc.trees.store import TreeStore

    t0 = time.perf_counter()
    trees = list(TreeStore.open(path).stream(timeout_s=0))
    return time.perf_counter() - t0, trees


def _numpy_append(path: Path, batches: list[list[Tree]], durable: bool) -> float:
    """Baseline: the same flat columns, one .npy per array per batch, fsynced like the store."""
    from gyre_hpc.trees.store_schema import flatten_trees

    t0 = time.perf_counter()
    path.mkdir()
    base = {"tree": 0, "token": 0, "node": 0, "call": 0, "dropped": 0, "sample": 0}
    for k, batch in enumerate(batches):
        cols = flatten_trees(batch, base)
        d = path / f"batch-{k:05d}"
        d.mkdir()
        for name, values in cols.items():
            np.save(d / f"{name}.npy", values, allow_pickle=values.dtype == object)
        if durable:
            for name in cols:
                fsio.sync_path(d / f"{name}.npy")
            fsio.sync_path(d)
        for tree in batch:
            base["tree"] += 1
            base["token"] += tree.n_tokens
            base["node"] += tree.n_nodes
            base["call"] += tree.n_paths
            base["dropped"] += len(tree.dropped_calls)
            base["sample"] += int(tree.sample_token.size)
    if durable:
        fsio.sync_path(path)
    return time.perf_counter() - t0


def _numpy_stream(path: Path) -> tuple[float, list[Tree]]:
    """Baseline read: load each batch's arrays and slice them into the same Tree objects."""
    from gyre_hpc.trees.store_schema import ARRAYS, tree_from_columns

    t0 = time.perf_counter()
    trees = []
    for d in sorted(path.iterdir()):
        cols = {s.name: np.load(d / f"{s.name}.npy", allow_pickle=s.dtype == "str") for s in ARRAYS}
        base = {"token": int(cols["token_offset"][0]), "node": int(cols["node_offset"][0]),
                "call": int(cols["call_offset"][0]), "dropped": int(cols["dropped_offset"][0]),
                "sample": int(cols["sample_offset"][0])}
        for i in range(cols["run_id"].shape[0]):
            row = {s.name: cols[s.name][i] for s in ARRAYS if s.dim == "tree"}
            spans = {"token": (row["token_offset"], row["n_tokens"]), "node": (row["node_offset"], row["n_nodes"]),
                     "call": (row["call_offset"], row["n_paths"]), "dropped": (row["dropped_offset"], row["n_dropped"]),
                     "sample": (row["sample_offset"], row["n_samples"])}
            part = {}
            for s in ARRAYS:
                if s.dim != "tree":
                    lo, n = spans[s.dim]
                    lo = int(lo) - base[s.dim]
                    part[s.name] = cols[s.name][lo:lo + int(n)]
            trees.append(tree_from_columns(row, part))
    return time.perf_counter() - t0, trees


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _measure(batches: list[list[Tree]], trees: list[Tree], repeats: int, durable: bool, tmp: Path) -> tuple[dict, dict]:
    timings: dict[str, list[float]] = {k: [] for k in ("store_append", "numpy_append", "store_stream", "numpy_stream")}
    sizes = {}
    for r in range(repeats):
        # Alternate which goes first so page-cache warmth favours neither.
        for kind in (("store", "numpy") if r % 2 == 0 else ("numpy", "store")):
            path = tmp / f"{kind}-{r}-{durable}"
            if kind == "store":
                timings["store_append"].append(_store_append(path, batches, durable))
                dt, got = _store_stream(path)
            else:
                timings["numpy_append"].append(_numpy_append(path, batches, durable))
                dt, got = _numpy_stream(path)
            timings[f"{kind}_stream"].append(dt)
            _check_same(got, trees, kind)
            sizes[kind] = _du(path)
            shutil.rmtree(path)
    return {k: float(np.median(v)) for k, v in timings.items()}, sizes


def run_bench(n_runs: int = 64, batch: int = 8, repeats: int = 3, seed: int = 0) -> dict:
    from gyre_hpc.trees.store import StoreLayout

    trees = synthetic_trees(n_runs, seed=seed)
    batches = [trees[i:i + batch] for i in range(0, len(trees), batch)]
    tokens = sum(t.n_tokens for t in trees)

    def figures(store_s: float, numpy_s: float) -> dict:
        return {"store_tokens_per_s": tokens / store_s, "numpy_tokens_per_s": tokens / numpy_s,
                "ratio_store_over_numpy": numpy_s / store_s, "store_s": store_s, "numpy_s": numpy_s}

    with tempfile.TemporaryDirectory(prefix="gyre-bench-store-") as tmp:
        durable, sizes = _measure(batches, trees, repeats, True, Path(tmp))
        volatile, _ = _measure(batches, trees, repeats, False, Path(tmp))
    return {
        "workload": {"source": "gyre_hpc.trees.synthetic journals -> build_tree", "trees": len(trees),
                     "tokens": tokens, "nodes": sum(t.n_nodes for t in trees),
                     "calls": sum(t.n_paths for t in trees), "trees_per_append": batch,
                     "appends": len(batches)},
        "append": figures(durable["store_append"], durable["numpy_append"]),
        "stream_read": figures(durable["store_stream"], durable["numpy_stream"]),
        "append_no_fsync": figures(volatile["store_append"], volatile["numpy_append"]),
        "stream_read_no_fsync": figures(volatile["store_stream"], volatile["numpy_stream"]),
        "bytes_on_disk": {"store": sizes["store"], "numpy": sizes["numpy"],
                          "ratio_store_over_numpy": sizes["store"] / sizes["numpy"]},
        "settings": {"repeats": repeats, "statistic": "median", "layout": StoreLayout().to_json(),
                     "store": "TreeStore.append per batch (validate, flatten, write, fsync in a thread "
                              "pool, commit marker); read = TreeStore.stream from a fresh reader",
                     "baseline": "numpy.save of the same flat columns, one .npy per array per append, "
                                 "each fsynced in turn (append) or not (append_no_fsync); "
                                 "read = numpy.load + slicing into the same Tree objects"},
    }


def _check_same(got: list[Tree], want: list[Tree], kind: str) -> None:
    """A bench that read back wrong data would measure nothing; compare a cheap digest."""
    if len(got) != len(want):
        raise RuntimeError(f"bench store: {kind} read {len(got)} trees, wrote {len(want)}")
    for a, b in zip(got, want):
        if a.run_id != b.run_id or not np.array_equal(a.tokens, b.tokens) or not np.array_equal(a.logprobs, b.logprobs):
            raise RuntimeError(f"bench store: {kind} read back run {a.run_id} differently from what was written")


@click.command()
@click.option("--runs", "n_runs", default=64, show_default=True, help="synthetic runs (trees) to store")
@click.option("--batch", default=8, show_default=True, help="trees per append (one commit)")
@click.option("--repeats", default=3, show_default=True, help="passes; figures are medians")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def command(n_runs: int, batch: int, repeats: int, seed: int, as_json: bool) -> None:
    """Tree store append and streaming-read tokens/s vs numpy.save/numpy.load of the same arrays."""
    for name, value in (("--runs", n_runs), ("--batch", batch), ("--repeats", repeats)):
        if value < 1:
            raise click.BadParameter(f"{name}={value}: must be >= 1")
    emit(run_bench(n_runs=n_runs, batch=batch, repeats=repeats, seed=seed), as_json)

"""``gyre-hpc bench store``: tree store append and streaming-read throughput (tokens/s)
beside a raw ``numpy.save``/``numpy.load`` of the very same flat arrays, in one run.

The baseline is what a store without commit markers, checksums, compression or xarray
readability would cost: one ``.npy`` per array per append batch, fsynced like the store,
then loaded back and sliced into the same ``Tree`` objects. The ratios say what the
store's guarantees cost.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from gyre_hpc.bench import emit
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

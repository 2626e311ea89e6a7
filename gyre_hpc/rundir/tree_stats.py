"""What the runs in ``trees.zarr`` did, read from the store's arrays alone (``xarray.open_zarr``).

Per run: model calls (kept paths plus those admission dropped), compressions, sub-agents,
retries, status and reward; over the store: the sharing ratio (tokens of every kept call's
path, expanded as if trained one path at a time, over the tokens stored) and the trained
share. Everything comes from the flat arrays (``call_node``, ``parent``, ``call_role``,
``dropped_call``...), so a notebook gets the same figures from the same Dataset.

How a retry is seen without the harness's text: the main agent's consecutive calls extend
one path until the context restarts, either because it was compressed (a summary call of
agent ``main`` sits between the two calls) or because a failed finish was retried. A
restart with a summary between is a compression; one with a call admission dropped between
(its role is not stored) is counted as a compression too, so retries are never
over-counted; any other restart is a retry branch.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from gyre_hpc.trees.model import ROLE_CODE

_ARRAYS = ("tokens", "trained", "node_len", "parent", "call_node", "call_role", "call_agent", "call_offset",
           "n_paths", "dropped_call", "dropped_offset", "n_dropped", "n_tokens", "status", "reward", "run_id")


def _depths_and_ends(node_len: np.ndarray, parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens above each node on its path, and one past the last node of its subtree."""
    n = node_len.size
    depth = np.zeros(n, dtype=np.int64)
    for i in range(n):
        p = parent[i]
        if p >= 0:
            depth[i] = depth[p] + node_len[p]
    end = np.arange(1, n + 1, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        p = parent[i]
        if p >= 0 and end[i] > end[p]:
            end[p] = end[i]
    return depth, end


def _percentiles(values: np.ndarray) -> dict:
    if values.size == 0:
        return {"mean": None, "p50": None, "p90": None, "max": None}
    return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
            "p90": float(np.percentile(values, 90)), "max": int(values.max())}


def run_shapes(ds: Mapping) -> list[dict]:
    """One dict per stored tree: run_id, calls, compressions, subagents, retries, status, reward, tokens."""
    a = {k: np.asarray(ds[k].values if hasattr(ds[k], "values") else ds[k]) for k in _ARRAYS}
    depth, sub_end = _depths_and_ends(a["node_len"].astype(np.int64), a["parent"].astype(np.int64))
    main, summary, subagent = ROLE_CODE["main"], ROLE_CODE["summary"], ROLE_CODE["subagent"]
    out = []
    for t in range(a["n_paths"].size):
        c0, nc = int(a["call_offset"][t]), int(a["n_paths"][t])
        d0, nd = int(a["dropped_offset"][t]), int(a["n_dropped"][t])
        dropped = np.sort(a["dropped_call"][d0:d0 + nd].astype(np.int64))
        journal = np.setdiff1d(np.arange(nc + nd), dropped)     # journal index of each kept call
        roles = a["call_role"][c0:c0 + nc]
        agents = [str(x) for x in a["call_agent"][c0:c0 + nc]]
        nodes = a["call_node"][c0:c0 + nc].astype(np.int64)
        retries = compressions = 0
        prev = None
        for k in range(nc):
            if agents[k] != "main" or roles[k] != main:
                continue
            if prev is not None:
                p, q = nodes[prev], nodes[k]
                if not (p <= q < sub_end[p]):            # the context restarted between prev and k
                    between = range(prev + 1, k)
                    summarized = any(roles[j] == summary and agents[j] == "main" for j in between)
                    lost = bool(((dropped > journal[prev]) & (dropped < journal[k])).any())
                    if summarized or lost:
                        compressions += not summarized
                    else:
                        retries += 1
            prev = k
        compressions += int((roles == summary).sum())
        expanded = int((depth[nodes] + a["node_len"][nodes]).sum())
        out.append({"run_id": str(a["run_id"][t]), "calls": nc + nd, "kept_calls": nc, "dropped_calls": nd,
                    "compressions": compressions, "subagent_calls": int((roles == subagent).sum()),
                    "retries": retries, "status": str(a["status"][t]), "reward": float(a["reward"][t]),
                    "expanded_tokens": expanded, "stored_tokens": int(a["n_tokens"][t])})
    return out


def store_stats(ds: Mapping) -> dict:
    """The run-shape summary ``gyre-hpc inspect --json`` reports under ``"shapes"``."""
    runs = run_shapes(ds)
    n = len(runs)
    if not n:
        return {"runs": 0}
    calls = np.array([r["calls"] for r in runs])
    timeouts = [r for r in runs if r["status"] == "timeout"]
    expanded = sum(r["expanded_tokens"] for r in runs)
    stored = sum(r["stored_tokens"] for r in runs)
    trained = int(np.asarray(ds["trained"].values if hasattr(ds["trained"], "values") else ds["trained"]).sum())
    frac = lambda key: sum(r[key] > 0 for r in runs) / n  # noqa: E731
    return {
        "runs": n,
        "calls_per_run": _percentiles(calls),
        "runs_with": {"compression": frac("compressions"), "subagent": frac("subagent_calls"),
                      "retry": frac("retries"), "timeout": len(timeouts) / n},
        "timeouts": {"runs": len(timeouts),
                     "reward_mean": float(np.mean([r["reward"] for r in timeouts])) if timeouts else None},
        "sharing_ratio": expanded / stored if stored else None,
        "expanded_path_tokens": expanded,
        "stored_tokens": stored,
        "trained_share": trained / stored if stored else None,
        "admission": {"dropped_calls": int(sum(r["dropped_calls"] for r in runs)),
                      "runs_with_drops": int(sum(r["dropped_calls"] > 0 for r in runs)),
                      "calls_total": int(calls.sum())},
    }

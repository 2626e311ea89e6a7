"""Admission: keep at most K paths (calls) of a run's tree, by role priority.

Order of preference: role first (main, then subagent, then summary: the main agent's
decisions are what the reward scores most directly; summaries are bookkeeping); within a
role, calls whose path no call of that role (or a preferred one) extends ("maximal"
paths) before prefix paths, because a maximal path carries every output along its
prefix; then journal order. Nodes that no kept path uses are pruned.

What stays trained: every position on a kept path that the policy generated keeps its
target (and every sample there, for ``train.shared_targets: per_sample``), even where the call that generated it was left out. That happens when a left-out
call's path is a prefix of a kept one (the usual case: call k+1's prompt extends call k's
prompt and output); its tokens sit in exactly the context the policy saw, so training
them is exact and costs nothing. Every left-out call is listed in ``dropped_calls``
(indices into the original journal) regardless, never silently.

Kept calls stay in journal order, so their original indices are the journal indices not
in ``dropped_calls``, in order.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from gyre_hpc.trees.builder import subtree_end_nodes
from gyre_hpc.trees.model import Tree


def admission_order(tree: Tree) -> list[int]:
    """Calls (tree-local indices) in the order admission prefers them.

    "Maximal" is judged against calls of the same or a preferred role only: a main call
    that only a summary call extends is still the longest main path.
    """
    sub_end = subtree_end_nodes(tree)
    continued = np.zeros(tree.n_paths, dtype=bool)
    for role in np.unique(tree.call_role):
        # Prefix counts of call ends (of this role or a preferred one) by node, so "does a
        # call end strictly below node n" is one subtraction.
        marks = np.zeros(tree.n_nodes + 1, dtype=np.int64)
        np.add.at(marks, tree.call_node[tree.call_role <= role] + 1, 1)
        ends_before = np.cumsum(marks)
        mine = np.flatnonzero(tree.call_role == role)
        n = tree.call_node[mine]
        continued[mine] = ends_before[sub_end[n]] - ends_before[n + 1] > 0
    return sorted(range(tree.n_paths), key=lambda c: (int(tree.call_role[c]), bool(continued[c]), c))


def admit(tree: Tree, max_paths: int) -> Tree:
    """At most ``max_paths`` calls of ``tree``; the rest recorded in ``dropped_calls``."""
    if max_paths < 1:
        raise ValueError(f"admit max_paths={max_paths} must be >= 1 (train.max_paths_per_run)")
    if tree.n_paths <= max_paths:
        return tree
    keep = sorted(admission_order(tree)[:max_paths])
    dropped_local = sorted(set(range(tree.n_paths)) - set(keep))

    used = np.zeros(tree.n_nodes, dtype=bool)
    for c in keep:
        used[tree.node_path(c)] = True
    # Kept nodes are closed under "parent of", so removing the rest removes whole subtrees
    # and the survivors are still in depth-first order with contiguous subtrees.
    old_nodes = np.flatnonzero(used)
    new_index = np.full(tree.n_nodes, -1, dtype=np.int64)
    new_index[old_nodes] = np.arange(old_nodes.size)
    token_keep = np.repeat(used, tree.node_len)
    node_len = tree.node_len[old_nodes]
    node_start = np.zeros(old_nodes.size, dtype=np.int64)
    node_start[1:] = np.cumsum(node_len[:-1], dtype=np.int64)
    parent = tree.parent[old_nodes]
    parent = np.where(parent >= 0, new_index[np.maximum(parent, 0)], -1).astype(np.int32)

    # A sample survives with its position: under per_sample a left-out call's sampling event
    # on a kept path trains too, for the same reason its position does under once.
    new_token = np.cumsum(token_keep) - 1
    sample_keep = token_keep[tree.sample_token]

    # Map this tree's call indices back to the original journal (the tree may be admitted already).
    original = np.setdiff1d(np.arange(tree.n_paths + len(tree.dropped_calls)), tree.dropped_calls)
    return replace(
        tree,
        tokens=tree.tokens[token_keep],
        logprobs=tree.logprobs[token_keep],
        trained=tree.trained[token_keep],
        node_start=node_start,
        node_len=node_len,
        parent=parent,
        node_role=tree.node_role[old_nodes],
        call_node=new_index[tree.call_node[keep]].astype(np.int32),
        call_role=tree.call_role[keep],
        call_agent=[tree.call_agent[c] for c in keep],
        dropped_calls=sorted(tree.dropped_calls + original[dropped_local].tolist()),
        sample_token=new_token[tree.sample_token[sample_keep]].astype(np.int64),
        sample_logprob=tree.sample_logprob[sample_keep],
        sample_run=tree.sample_run[sample_keep],
        sample_call=tree.sample_call[sample_keep],
    )


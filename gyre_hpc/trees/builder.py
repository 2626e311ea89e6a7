"""Build a run's prefix-shared token tree from its journal of model calls.

The tree is a radix trie over each call's ``prompt + output``: a node is a run of tokens
that every call passing through it shares. Nodes split where calls diverge and where a
call's sequence ends, so every call's path ends exactly at a node end.

What is trained. A trie position is a target iff some call *generated* the token there,
i.e. the position lies in that call's output. Positions are compared as whole prefixes,
so:

* the next call's prompt usually is ``previous prompt + output + tool text``: the
  previous output is the same trie position and is trained once, by the call that
  generated it;
* a prompt that repeats an earlier output somewhere else (a summary quoted at the top of
  a fresh context, a sub-agent's answer pasted into the main context) is a different
  trie position and stays context;
* a retry that regenerates an identical output from the same context walks the same trie
  path: trained once, with the behaviour logprobs of the *first* call in journal order
  that generated the position. Why the first: building from a longer journal never
  changes an earlier tree's targets or logprobs, and either call's logprob is the
  probability of that very token in that very context under a policy that sampled it;
* an empty output trains nothing; the call's path ends at its prompt;
* a prompt that shares no first token with earlier calls starts a new root (parent -1):
  a Tree is a forest.

Order: nodes are flattened depth-first, children in the order they were first created,
so ``parent[i] < i`` and each subtree is a contiguous token interval.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from gyre_hpc.trees.model import ROLE_CODE, STATUSES, ModelCall, Tree


class _Node:
    __slots__ = ("tokens", "trained", "logprobs", "children", "role")

    def __init__(self, tokens: np.ndarray, role: int):
        self.tokens = tokens
        self.trained = np.zeros(tokens.size, dtype=bool)
        self.logprobs = np.zeros(tokens.size, dtype=np.float32)
        self.children: dict[int, _Node] = {}
        self.role = role

    def split_head(self, at: int) -> "_Node":
        """Move ``tokens[:at]`` into a new parent node and return it.

        The new node takes the head, not the tail, so a call whose path already ended
        at this node still ends at this object's last token.
        """
        head = _Node(self.tokens[:at], self.role)
        head.trained, head.logprobs = self.trained[:at], self.logprobs[:at]
        self.tokens, self.trained, self.logprobs = self.tokens[at:], self.trained[at:], self.logprobs[at:]
        head.children = {int(self.tokens[0]): self}
        return head


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _insert(root: _Node, seq: np.ndarray, out_start: int, logprobs: np.ndarray, role: int) -> _Node:
    """Walk/extend the trie along ``seq``; mark positions >= out_start as generated."""
    node, i = root, 0
    while i < seq.size:
        child = node.children.get(int(seq[i]))
        if child is None:
            child = _Node(seq[i:].copy(), role)
            node.children[int(seq[i])] = child
            n = child.tokens.size
        else:
            n = _common_prefix(child.tokens, seq[i:])
            if n < child.tokens.size:
                child = node.children[int(seq[i])] = child.split_head(n)
        lo = max(out_start - i, 0)
        if lo < n:
            fresh = ~child.trained[lo:n]  # first generator wins
            child.logprobs[lo:n][fresh] = logprobs[i + lo - out_start:i + n - out_start][fresh]
            child.trained[lo:n] = True
        node, i = child, i + n
    return node


def build_tree(
    calls: Sequence[ModelCall],
    *,
    run_id: str = "",
    task_id: str = "",
    reward: float = 0.0,
    status: str = "finished",
    policy_version: int = 0,
    wall_s: float = 0.0,
) -> Tree:
    """One run's journal -> its Tree (see the module docstring for what is trained)."""
    if status not in STATUSES:
        raise ValueError(f"build_tree status={status!r}: valid statuses are {', '.join(STATUSES)}")
    if not np.isfinite(reward):
        raise ValueError(f"build_tree reward={reward!r} for run {run_id!r} is not a finite number")
    root = _Node(np.zeros(0, dtype=np.int32), ROLE_CODE["main"])
    ends: list[_Node] = []
    for c, call in enumerate(calls):
        if call.prompt.size == 0:
            raise ValueError(
                f"run {run_id!r} call {c}: empty prompt; a causal LM needs at least one context token (BOS)")
        if not np.all(np.isfinite(call.logprobs)):
            raise ValueError(f"run {run_id!r} call {c}: logprobs contain NaN or inf")
        seq = np.concatenate([call.prompt, call.output])
        ends.append(_insert(root, seq, call.prompt.size, call.logprobs, ROLE_CODE[call.role]))

    # Depth-first preorder, children in creation order; iterative because paths can be
    # thousands of nodes deep in long runs.
    order: list[_Node] = []
    parents: list[int] = []
    stack = [(child, -1) for child in reversed(root.children.values())]
    while stack:
        node, parent = stack.pop()
        index = len(order)
        order.append(node)
        parents.append(parent)
        stack.extend((child, index) for child in reversed(node.children.values()))
    index_of = {id(n): i for i, n in enumerate(order)}

    node_len = np.array([n.tokens.size for n in order], dtype=np.int32)
    node_start = np.zeros(len(order), dtype=np.int64)
    if len(order):
        node_start[1:] = np.cumsum(node_len[:-1], dtype=np.int64)
    cat = lambda arrays, dtype: np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)  # noqa: E731
    return Tree(
        tokens=cat([n.tokens for n in order], np.int32),
        logprobs=cat([n.logprobs for n in order], np.float32),
        trained=cat([n.trained for n in order], bool),
        node_start=node_start,
        node_len=node_len,
        parent=np.array(parents, dtype=np.int32),
        node_role=np.array([n.role for n in order], dtype=np.int8),
        call_node=np.array([index_of[id(e)] for e in ends], dtype=np.int32),
        call_role=np.array([ROLE_CODE[c.role] for c in calls], dtype=np.int8),
        call_agent=[c.agent for c in calls],
        run_id=run_id,
        task_id=task_id,
        reward=float(reward),
        status=status,
        policy_version=int(policy_version),
        wall_s=float(wall_s),
    )


def node_depth(tree: Tree) -> np.ndarray:
    """Tokens on the path above each node: the position id of the node's first token."""
    depth = np.zeros(tree.n_nodes, dtype=np.int64)
    for i in range(tree.n_nodes):
        p = tree.parent[i]
        if p >= 0:
            depth[i] = depth[p] + tree.node_len[p]
    return depth


def subtree_end_nodes(tree: Tree) -> np.ndarray:
    """One past the last node of each node's subtree (preorder makes subtrees contiguous)."""
    end = np.arange(1, tree.n_nodes + 1, dtype=np.int64)
    for i in range(tree.n_nodes - 1, -1, -1):
        p = tree.parent[i]
        if p >= 0:
            end[p] = max(end[p], end[i])
    return end

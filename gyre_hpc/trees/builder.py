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
  path: the position is stored once but carries one *sample* per call that generated it,
  each with that call's own behaviour logprob (``Tree.sample_*``; ``multiplicity`` counts
  them). ``train.shared_targets`` decides whether it trains once (the first call in
  journal order: ``trained``/``logprobs``) or once per sample (the unbiased estimator);
* an empty output trains nothing; the call's path ends at its prompt;
* a prompt that shares no first token with earlier calls starts a new root (parent -1):
  a Tree is a forest.

Order: nodes are flattened depth-first, children in the order they were first created,
so ``parent[i] < i`` and each subtree is a contiguous token interval.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from gyre_hpc.trees.calls import CallIncrement, CallLog, common_prefix
from gyre_hpc.trees.model import ROLE_CODE, STATUSES, ModelCall, Tree


class _Node:
    __slots__ = ("tokens", "children", "role", "parent")

    def __init__(self, tokens: np.ndarray, role: int, parent: "_Node | None" = None):
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.role = role
        self.parent = parent

    def split_head(self, at: int) -> "_Node":
        """Move ``tokens[:at]`` into a new parent node and return it.

        The new node takes the head, not the tail, so a call whose path already ended
        at this node still ends at this object's last token.
        """
        head = _Node(self.tokens[:at], self.role, self.parent)
        self.tokens = self.tokens[at:]
        head.children = {int(self.tokens[0]): self}
        self.parent = head
        return head


def _insert(start: _Node, seq: np.ndarray, role: int) -> _Node:
    """Walk/extend the trie from the end of ``start`` along ``seq``; return the node it ends at.

    Splits keep the tail object (``split_head``), so a node returned here still ends at the
    same token after any later insert: the group forest relies on that too.
    """
    node, i = start, 0
    while i < seq.size:
        child = node.children.get(int(seq[i]))
        if child is None:
            child = _Node(seq[i:].copy(), role, node)
            node.children[int(seq[i])] = child
            n = child.tokens.size
        else:
            n = common_prefix(child.tokens, seq[i:])
            if n < child.tokens.size:
                child = node.children[int(seq[i])] = child.split_head(n)
        node, i = child, i + n
    return node


def _position(end: _Node, excess: int) -> tuple[_Node, int]:
    """The trie position ``excess`` tokens above the end of node ``end`` on its path, as (node,
    tokens of it taken): walks up whole nodes, so it costs the nodes between, not the tokens."""
    node = end
    while excess >= node.tokens.size and node.parent is not None:
        excess -= node.tokens.size
        node = node.parent
    return node, node.tokens.size - excess


def _insert_at(node: _Node, taken: int, seq: np.ndarray, role: int) -> _Node:
    """``_insert`` starting ``taken`` tokens into ``node`` (a position on a path already in the
    trie): the rest of the node is compared first, split where ``seq`` leaves it or ends, exactly
    as a walk from the root along the same prefix would."""
    rest = node.tokens.size - taken
    if rest > 0:
        n = common_prefix(node.tokens[taken:], seq)
        if n < rest:
            head = node.split_head(taken + n)
            head.parent.children[int(head.tokens[0])] = head
            node = head
        seq = seq[n:]
    return _insert(node, seq, role)


def _flatten(root: _Node) -> tuple[list[_Node], np.ndarray, np.ndarray, np.ndarray]:
    """Depth-first preorder, children in creation order: (nodes, parent, node_start, node_len).

    Iterative because paths can be thousands of nodes deep in long runs."""
    order: list[_Node] = []
    parents: list[int] = []
    stack = [(child, -1) for child in reversed(root.children.values())]
    while stack:
        node, parent = stack.pop()
        index = len(order)
        order.append(node)
        parents.append(parent)
        stack.extend((child, index) for child in reversed(node.children.values()))
    node_len = np.array([n.tokens.size for n in order], dtype=np.int32)
    node_start = np.zeros(len(order), dtype=np.int64)
    if len(order):
        node_start[1:] = np.cumsum(node_len[:-1], dtype=np.int64)
    return order, np.array(parents, dtype=np.int32), node_start, node_len


def path_tail(parent: np.ndarray, node_start: np.ndarray, node_len: np.ndarray, node: int, k: int) -> np.ndarray:
    """Token indices of the last ``k`` tokens of the root-to-``node`` path, in path order."""
    parts, need = [], k
    while need > 0:
        if node < 0:
            raise ValueError(f"path_tail: the path is shorter than {k} tokens")
        take = min(need, int(node_len[node]))
        end = int(node_start[node]) + int(node_len[node])
        parts.append(np.arange(end - take, end, dtype=np.int64))
        need -= take
        node = int(parent[node])
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)


def build_tree(
    calls: Sequence[ModelCall] | CallLog,
    *,
    run_id: str = "",
    task_id: str = "",
    reward: float = 0.0,
    status: str = "finished",
    policy_version: int = 0,
    wall_s: float = 0.0,
) -> Tree:
    """One run's journal -> its Tree (see the module docstring for what is trained).

    A ``CallLog`` (the harness's and the journal's calls) is built from its increments: each
    call is inserted from the trie position of the prefix it shares with its base call, so the
    cost follows the run's new tokens, not its prompts (which sum to calls x context). A plain
    sequence of ``ModelCall`` is inserted whole, prompt by prompt from the root. Both give the
    same tree, bit for bit (the trie position of a prefix does not depend on how it is reached).
    """
    if status not in STATUSES:
        raise ValueError(f"build_tree status={status!r}: valid statuses are {', '.join(STATUSES)}")
    if not np.isfinite(reward):
        raise ValueError(f"build_tree reward={reward!r} for run {run_id!r} is not a finite number")
    root = _Node(np.zeros(0, dtype=np.int32), ROLE_CODE["main"])
    ends: list[_Node] = []
    steps = calls.increments if isinstance(calls, CallLog) else calls
    for c, call in enumerate(steps):
        if not np.all(np.isfinite(call.logprobs)):
            raise ValueError(f"run {run_id!r} call {c}: logprobs contain NaN or inf")
        if isinstance(call, CallIncrement):
            if call.prompt_len == 0:
                raise ValueError(
                    f"run {run_id!r} call {c}: empty prompt; a causal LM needs at least one context token (BOS)")
            seq = np.concatenate([call.new, call.output])
            if call.base < 0:
                ends.append(_insert(root, seq, ROLE_CODE[call.role]))
            else:
                node, taken = _position(ends[call.base], calls.seq_len(call.base) - call.shared)
                ends.append(_insert_at(node, taken, seq, ROLE_CODE[call.role]))
            continue
        if call.prompt.size == 0:
            raise ValueError(
                f"run {run_id!r} call {c}: empty prompt; a causal LM needs at least one context token (BOS)")
        ends.append(_insert(root, np.concatenate([call.prompt, call.output]), ROLE_CODE[call.role]))

    order, parent, node_start, node_len = _flatten(root)
    index_of = {id(n): i for i, n in enumerate(order)}
    call_node = np.array([index_of[id(e)] for e in ends], dtype=np.int32)
    # Every call's output is the tail of its own path: one sample per generated token.
    tok = [path_tail(parent, node_start, node_len, int(call_node[c]), call.output.size) for c, call in enumerate(steps)]
    return _assemble(
        order, parent, node_start, node_len, call_node,
        call_role=np.array([ROLE_CODE[c.role] for c in steps], dtype=np.int8), call_agent=[c.agent for c in steps],
        sample_token=_cat(tok, np.int64), sample_logprob=_cat([c.logprobs for c in steps], np.float32),
        sample_run=np.zeros(sum(t.size for t in tok), np.int32),
        sample_call=_cat([np.full(t.size, c) for c, t in enumerate(tok)], np.int32),
        run_id=run_id, task_id=task_id, reward=float(reward), status=status,
        policy_version=int(policy_version), wall_s=float(wall_s))


def _cat(arrays, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if len(arrays) else np.zeros(0, dtype)


def _assemble(order: list[_Node], parent, node_start, node_len, call_node, *, call_role, call_agent,
              sample_token, sample_logprob, sample_run, sample_call, **meta) -> Tree:
    """The Tree of a flattened trie and its samples, sorted by token, run, then journal order
    (``Tree.targets`` relies on that order); ``trained``/``logprobs`` are the first samples."""
    # A stable sort: samples of unknown call (-1, schema-1 data) keep their given order.
    idx = np.lexsort((sample_call, sample_run, sample_token))
    sample_token, sample_logprob = sample_token[idx].astype(np.int64), sample_logprob[idx].astype(np.float32)
    n_tokens = int(node_len.sum())
    trained = np.zeros(n_tokens, dtype=bool)
    logprobs = np.zeros(n_tokens, dtype=np.float32)
    first = np.ones(sample_token.size, dtype=bool)
    first[1:] = sample_token[1:] != sample_token[:-1]
    trained[sample_token] = True
    logprobs[sample_token[first]] = sample_logprob[first]
    return Tree(
        tokens=_cat([n.tokens for n in order], np.int32),
        logprobs=logprobs,
        trained=trained,
        node_start=node_start,
        node_len=node_len,
        parent=parent,
        node_role=np.array([n.role for n in order], dtype=np.int8),
        call_node=np.asarray(call_node, dtype=np.int32),
        call_role=call_role,
        call_agent=call_agent,
        sample_token=sample_token,
        sample_logprob=sample_logprob,
        sample_run=sample_run[idx].astype(np.int32),
        sample_call=sample_call[idx].astype(np.int32),
        **meta,
    )


def group_forest(trees: Sequence[Tree]) -> Tree:
    """The runs of one advantage group as one prefix-shared forest, for packing.

    The runs of a group start from the same task prompt (and often the same opening), which
    a per-run pack stores and computes once per run. Here every run's nodes are inserted
    into one trie, so a prefix common to several runs is one node: computed once, attended
    by each run's continuations exactly as in its own tree (same tokens, same positions,
    same ancestors). Every sample keeps its run (``sample_run`` = index in ``trees``) and its
    own behaviour logprob, so the loss, which weighs each sample by its run, is unchanged;
    only the recomputation of the shared prefix goes. A forest is never stored
    (``n_runs > 1``); the runs' own trees are.
    """
    root = _Node(np.zeros(0, dtype=np.int32), ROLE_CODE["main"])
    ends: list[list[_Node]] = []
    for tree in trees:
        end: list[_Node] = []
        for i in range(tree.n_nodes):
            p = int(tree.parent[i])
            g0 = int(tree.node_start[i])
            seq = np.asarray(tree.tokens[g0:g0 + int(tree.node_len[i])], dtype=np.int32)
            if seq.size == 0:
                raise ValueError(f"group_forest: run {tree.run_id!r} node {i} is empty")
            end.append(_insert(root if p < 0 else end[p], seq, int(tree.node_role[i])))
        ends.append(end)
    order, parent, node_start, node_len = _flatten(root)
    index_of = {id(n): i for i, n in enumerate(order)}
    tok, lp, run, call_node = [], [], [], []
    for r, (tree, end) in enumerate(zip(trees, ends)):
        # Where each of the run's tokens sits in the forest: node i's tokens are the tail of
        # the forest path that ends where node i ended.
        where = np.zeros(tree.n_tokens, dtype=np.int64)
        for i in range(tree.n_nodes):
            g0 = int(tree.node_start[i])
            where[g0:g0 + int(tree.node_len[i])] = path_tail(parent, node_start, node_len, index_of[id(end[i])],
                                                             int(tree.node_len[i]))
        tok.append(where[tree.sample_token])
        lp.append(tree.sample_logprob)
        run.append(np.full(tree.sample_token.size, r, dtype=np.int32))
        call_node.extend(index_of[id(end[int(n)])] for n in tree.call_node)
    sample_run = _cat(run, np.int32)
    return _assemble(
        order, parent, node_start, node_len, call_node,
        call_role=_cat([t.call_role for t in trees], np.int8), call_agent=[a for t in trees for a in t.call_agent],
        sample_token=_cat(tok, np.int64), sample_logprob=_cat(lp, np.float32), sample_run=sample_run,
        sample_call=_cat([t.sample_call for t in trees], np.int32),
        run_id="+".join(t.run_id for t in trees), task_id=trees[0].task_id if trees else "", n_runs=len(trees))


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

"""Pack trees depth-first into rows of a token budget, with what tree attention needs.

Per token a row holds its input id, its position id (its depth along its own path), the
row index of its path predecessor, and ``subtree_end``: one past the last row index of
the subtree of the node it belongs to. Rows are in depth-first order, so "a token sees
its ancestors and itself" is the interval test ``kv <= q < subtree_end[kv]``.

Targets. In a tree a node's last token has one "next token" per child, so targets are
not stored as a shifted copy of the inputs. Instead each trained token j names its path
predecessor ``pred_index[j]``; the loss reads the logits at ``pred_index[j]`` and scores
``input_ids[j]`` under them. That is exactly the causal-LM rule "the logits at position
t predict token t+1", applied along each token's own path.

Splitting. Rows are cut at node boundaries: a node that does not fit in the room left
starts the next row, which first repeats the node's ancestors as context: same tokens,
same positions, no loss (``loss_mask`` False), so each trained token is scored once, in
the row that owns it. A node is never cut, because the ancestors plus the node are one
call's path at most, so a row that holds the longest path holds any node with its
context, and cutting would only repeat the node's head as well.

Samples. A trained position can carry several sampling events (calls that generated the
same tokens from the same context; runs of a group forest sharing an opening). The row
lists the targets the ``shared_targets`` rule keeps (``Tree.targets``): ``sample_index`` (row
token), ``sample_logprobs`` (that sample's behaviour logprob) and ``sample_run`` (index of its
run among all runs of the units given to ``pack``: unit k's runs start after the ``n_runs`` of
units before it, so with plain trees it is the tree's index). The loss scores each sample.

Deep trees. A tree with a path longer than the row budget is not split at all: it is one
row of its own, trained in chunks of the budget (see :func:`pack`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gyre_hpc.models.tiny_lm import PAD_ID
from gyre_hpc.trees.builder import node_depth
from gyre_hpc.trees.model import SHARED_TARGETS, Tree


@dataclass(frozen=True)
class PackedRow:
    """One row of packed tokens (all arrays [L], row-local indices)."""

    input_ids: np.ndarray        # int64
    position_ids: np.ndarray     # int64, depth along the token's own path
    subtree_end: np.ndarray      # int64, kv is visible to q iff kv <= q < subtree_end[kv]
    pred_index: np.ndarray       # int64, row index of the path predecessor, -1 for a path's first token
    loss_mask: np.ndarray        # bool, trained and owned by this row
    behaviour_logprobs: np.ndarray  # float32, meaningful where loss_mask
    run_index: np.ndarray        # int64, index of the token's packing unit in the list given to pack()
    sample_index: np.ndarray     # int64 [S], row index of each target's token
    sample_logprobs: np.ndarray  # float32 [S], that target's behaviour logprob
    sample_run: np.ndarray       # int64 [S], run of the target (see module docstring)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.size)

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def n_samples(self) -> int:
        return int(self.sample_index.size)


@dataclass
class _Span:
    """A whole node placed in a row; owned = its trained tokens are scored in this row."""

    run: int
    node: int
    length: int
    owned: bool


class _RowBuilder:
    def __init__(self, trees: Sequence[Tree], depths: list[np.ndarray], targets: list[tuple]):
        self.trees, self.depths, self.targets = trees, depths, targets
        self.spans: list[_Span] = []
        self.length = 0

    def add(self, span: _Span) -> None:
        self.spans.append(span)
        self.length += span.length

    def finish(self) -> PackedRow:
        L = self.length
        ids = np.empty(L, np.int64)
        pos = np.empty(L, np.int64)
        pred = np.empty(L, np.int64)
        loss = np.zeros(L, bool)
        blp = np.zeros(L, np.float32)
        run = np.empty(L, np.int64)
        end = np.empty(L, np.int64)
        samples: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        # Row offset of each (run, node), for predecessors and subtree ends.
        base: dict[tuple[int, int], int] = {}
        at = 0
        for s in self.spans:
            tree, key, n = self.trees[s.run], (s.run, s.node), s.length
            base[key] = at
            g0 = int(tree.node_start[s.node])
            sl = slice(at, at + n)
            ids[sl] = tree.tokens[g0:g0 + n]
            pos[sl] = self.depths[s.run][s.node] + np.arange(n)
            run[sl] = s.run
            pred[sl] = np.arange(at - 1, at + n - 1)
            parent = int(tree.parent[s.node])
            pred[at] = -1 if parent < 0 else base[(s.run, parent)] + int(tree.node_len[parent]) - 1
            if s.owned:
                tok, lp, sr = self.targets[s.run]
                lo, hi = np.searchsorted(tok, [g0, g0 + n])
                samples.append((tok[lo:hi] - g0 + at, lp[lo:hi], sr[lo:hi]))
                loss[tok[lo:hi] - g0 + at] = True
                blp[sl] = tree.logprobs[g0:g0 + n]
            at += n
        # A node's subtree ends where its last descendant in this row ends; rows are preorder,
        # so propagate ends from the back to parents.
        sub_end = {key: base[key] + self.trees[key[0]].node_len[key[1]] for key in base}
        for key in reversed(list(base)):
            pkey = (key[0], int(self.trees[key[0]].parent[key[1]]))
            if pkey in sub_end:
                sub_end[pkey] = max(sub_end[pkey], sub_end[key])
        for key, start in base.items():
            end[start:start + self.trees[key[0]].node_len[key[1]]] = sub_end[key]
        cat = lambda k, dtype: np.concatenate([x[k] for x in samples]).astype(dtype) if samples else np.zeros(0, dtype)  # noqa: E731
        return PackedRow(ids, pos, end, pred, loss, blp, run, cat(0, np.int64), cat(1, np.float32), cat(2, np.int64))


def pack(trees: Sequence[Tree], row_tokens: int, shared_targets: str = "per_sample") -> list[PackedRow]:
    """Trees (or group forests) depth-first into rows of at most ``row_tokens`` tokens, with
    the targets of the ``shared_targets`` rule (see module docstring).

    A tree with a path deeper than ``row_tokens`` gets one row of its own holding the whole
    tree, longer than ``row_tokens``: split rows would each repeat the deep ancestors, so
    the tokens packed would grow with depth x rows. Such a row trains in chunks of
    ``row_tokens`` (:func:`gyre_hpc.trees.chunked.backward_packed`), exactly.
    """
    if row_tokens < 2:
        raise ValueError(f"pack row_tokens={row_tokens} must be >= 2")
    if shared_targets not in SHARED_TARGETS:
        raise ValueError(f"pack shared_targets={shared_targets!r}: valid rules are {', '.join(SHARED_TARGETS)}")
    depths = [node_depth(t) for t in trees]
    run_offset = np.cumsum([0] + [t.n_runs for t in trees])
    targets = []
    for k, t in enumerate(trees):
        tok, lp, sr = t.targets(shared_targets)
        targets.append((tok, lp, sr.astype(np.int64) + run_offset[k]))
    rows: list[PackedRow] = []
    row = _RowBuilder(trees, depths, targets)
    for r, tree in enumerate(trees):
        if tree.n_nodes and int((depths[r] + tree.node_len).max()) > row_tokens:
            if row.length:
                rows.append(row.finish())
                row = _RowBuilder(trees, depths, targets)
            for node in range(tree.n_nodes):
                row.add(_Span(r, node, int(tree.node_len[node]), owned=True))
            rows.append(row.finish())
            row = _RowBuilder(trees, depths, targets)
            continue
        for node in range(tree.n_nodes):
            need = int(tree.node_len[node])
            if row.length + need > row_tokens:
                # A node is never cut: cutting it would repeat its head as context in the
                # next row, while a row left short costs nothing (rows are not padded
                # unless collated together).
                if row.length:
                    rows.append(row.finish())
                row = _RowBuilder(trees, depths, targets)
                _add_context(row, tree, r, node)
            row.add(_Span(r, node, need, owned=True))
    if row.length:
        rows.append(row.finish())
    return rows


def _add_context(row: _RowBuilder, tree: Tree, run: int, node: int) -> None:
    """Open a row with the ancestors of ``node``, as context only (no loss)."""
    chain = []
    p = int(tree.parent[node])
    while p >= 0:
        chain.append(p)
        p = int(tree.parent[p])
    for a in reversed(chain):
        row.add(_Span(run, a, int(tree.node_len[a]), owned=False))


@dataclass(frozen=True)
class PackedBatch:
    """Rows padded to one length as torch tensors [B, L]; padding sees only itself, trains nothing."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    subtree_end: torch.Tensor
    pred_index: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    run_index: torch.Tensor
    sample_row: torch.Tensor       # [S] batch row of each target
    sample_index: torch.Tensor     # [S] position of its token in that row
    sample_logprobs: torch.Tensor  # [S]
    sample_run: torch.Tensor       # [S]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)


def collate(rows: Sequence[PackedRow], device: torch.device | str = "cpu", pad_to: int | None = None) -> PackedBatch:
    if not rows:
        raise ValueError("collate: no rows")
    L = max(r.n_tokens for r in rows) if pad_to is None else pad_to
    if L < max(r.n_tokens for r in rows):
        raise ValueError(f"collate pad_to={pad_to} is shorter than the longest row ({max(r.n_tokens for r in rows)})")
    B = len(rows)
    ids = np.full((B, L), PAD_ID, np.int64)
    pos = np.zeros((B, L), np.int64)
    # Padding token i gets subtree_end i+1: it is visible only to itself, and as a query it
    # sees itself, so no attention row is empty (an empty row would be NaN in SDPA).
    end = np.tile(np.arange(1, L + 1, dtype=np.int64), (B, 1))
    pred = np.full((B, L), -1, np.int64)
    loss = np.zeros((B, L), bool)
    blp = np.zeros((B, L), np.float32)
    run = np.full((B, L), -1, np.int64)
    for b, r in enumerate(rows):
        n = r.n_tokens
        ids[b, :n], pos[b, :n], end[b, :n] = r.input_ids, r.position_ids, r.subtree_end
        pred[b, :n], loss[b, :n], blp[b, :n], run[b, :n] = r.pred_index, r.loss_mask, r.behaviour_logprobs, r.run_index
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    samples = (np.concatenate([np.full(r.n_samples, b, np.int64) for b, r in enumerate(rows)]),
               np.concatenate([r.sample_index for r in rows]).astype(np.int64),
               np.concatenate([r.sample_logprobs for r in rows]).astype(np.float32),
               np.concatenate([r.sample_run for r in rows]).astype(np.int64))
    return PackedBatch(t(ids), t(pos), t(end), t(pred), t(loss), t(blp), t(run), *map(t, samples))

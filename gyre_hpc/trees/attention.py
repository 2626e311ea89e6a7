"""Tree attention for packed rows: "a token sees its ancestors and itself".

In a depth-first row that rule is the interval test ``kv <= q < subtree_end[kv]``. Two
kernels implement it behind one switch (``train.attention``):

* ``flex``: ``torch.nn.attention.flex_attention`` with a BlockMask built from the
  interval test; blocks of the mask that are all False are skipped entirely, so the cost
  follows the tree, not T^2. The GPU path. (torch 2.13 on CPU runs its forward but its
  backward raises NotImplementedError.)
* ``sdpa``: ``scaled_dot_product_attention`` per block of queries, over only the keys
  that block can reach (its ancestors and itself, gathered), with a boolean mask of
  ``block x K`` entries, K ~ path depth + block: never T x T, and the cost follows the
  tree rather than the row length. Backward recomputes each block (activation
  checkpointing per block), so neither the masks nor the block x K probabilities are
  kept: memory linear in the row length. The CPU path.
* ``auto``: flex on CUDA, sdpa elsewhere.
* ``invariant``: ``models.invariant.attention`` per path segment, over the path's keys in
  position order: bit for bit the attention TorchEngine's invariant mode computed when it
  sampled each token (``model.numerics: invariant`` selects it, with the model's invariant
  products). Slower than sdpa (one call per segment of a path, keys gathered per segment).

Both are ``attention_fn(q, k, v)`` objects for :class:`gyre_hpc.models.tiny_lm.TinyLM`,
built once per batch and shared by every layer.
"""
from __future__ import annotations

import functools
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gyre_hpc.models import invariant as inv

Backend = Literal["auto", "sdpa", "flex", "invariant"]
BACKENDS = ("auto", "sdpa", "flex", "invariant")


def resolve_backend(backend: str, device: torch.device | str, needs_grad: bool = True) -> str:
    """``auto`` -> the kernel for this device; refuse flex training where torch cannot run it."""
    if backend not in BACKENDS:
        raise ValueError(f"train.attention={backend!r}: valid backends are {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type != "cuda" and needs_grad:
        raise ValueError(
            "train.attention='flex' needs a CUDA device to train: torch's flex_attention has no CPU "
            "backward; use 'sdpa' or 'auto' on CPU")
    return backend


def tree_key_index(subtree_end: torch.Tensor, q_start: int, q_end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys some query in [q_start, q_end) may see, as indices [B, K] and a validity mask.

    kv is visible to some q in the block iff kv < q_end and subtree_end[kv] > q_start (its
    subtree reaches into the block). That is the block's ancestors plus the block itself, so
    K is about path depth + block size however long the row is: attention cost follows the
    tree, not the row length. Rows with fewer keys are padded (index 0, valid False).
    """
    reach = subtree_end[:, :q_end] > q_start
    counts = reach.sum(dim=1)
    n_keys = int(counts.max())
    # A stable sort on "not reachable" lists the reachable keys first, in row order.
    index = torch.sort((~reach).to(torch.int8), dim=1, stable=True).indices[:, :n_keys]
    valid = torch.arange(n_keys, device=subtree_end.device)[None, :] < counts[:, None]
    return index, valid


def tree_mask_block(subtree_end: torch.Tensor, q_start: int, q_end: int,
                    key_index: torch.Tensor | None = None, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask [B, 1, q_end-q_start, K] for queries [q_start, q_end).

    Without ``key_index`` the keys are [0, q_end) (keys past the block's last query are
    never visible, kv <= q); with it, only the keys :func:`tree_key_index` selected.
    """
    q = torch.arange(q_start, q_end, device=subtree_end.device)[:, None]
    if key_index is None:
        kv = torch.arange(q_end, device=subtree_end.device)[None, None, :]
        end = subtree_end[:, None, :q_end]
    else:
        kv = key_index[:, None, :]
        end = subtree_end.gather(1, key_index)[:, None, :]
    visible = (kv <= q) & (q < end)
    if key_valid is not None:
        visible &= key_valid[:, None, :]
    return visible[:, None]


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _block_keys(subtree_end: torch.Tensor, q_start: int, q_end: int, k: torch.Tensor, v: torch.Tensor):
    """The keys and values queries [q_start, q_end) can reach, the block's additive mask, the gather index.

    On one path (or wherever every key before the block is an ancestor of all its queries)
    the reachable keys are the prefix [0, q_end): sliced as views (index None), and only the
    block's own square of the mask needs the interval test; the rest is zeros. Otherwise the
    reachable keys are gathered and the whole mask is computed.
    """
    index, valid = tree_key_index(subtree_end, q_start, q_end)
    if k.shape[0] == 1 and index.shape[1] == q_end:
        if q_start == 0 or int(subtree_end[0, :q_start].min()) >= q_end:
            mask = torch.zeros((1, 1, q_end - q_start, q_end), dtype=k.dtype, device=k.device)
            own = torch.arange(q_start, q_end, device=k.device)[None]
            mask[..., q_start:] = _additive(tree_mask_block(subtree_end, q_start, q_end, own), k.dtype)
        else:
            mask = _additive(tree_mask_block(subtree_end, q_start, q_end), k.dtype)
        return k[:, :, :q_end], v[:, :, :q_end], mask, None
    B, H, _, D = k.shape
    gather = index[:, None, :, None].expand(B, H, index.shape[1], D)
    mask = _additive(tree_mask_block(subtree_end, q_start, q_end, index, valid), k.dtype)
    return k.gather(2, gather), v.gather(2, gather), mask, gather


def _attend_block(subtree_end: torch.Tensor, q_start: int, q_end: int,
                  q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Queries [q_start, q_end) over the keys they can reach; everything here is recomputable.

    Key selection and mask are made here, not kept per block: kept for every block they
    would total T^2/block indices, and under checkpointing they are rebuilt in backward.
    """
    kb, vb, mask, _ = _block_keys(subtree_end, q_start, q_end, k, v)
    return F.scaled_dot_product_attention(q, kb, vb, attn_mask=mask)


class _FlashTreeAttention(torch.autograd.Function):
    """Blocked tree attention keeping only the output and log-sum-exp for backward (CPU).

    The same flash kernels SDPA uses on CPU (bitwise the same forward), called per block:
    forward keeps q, k, v (alive anyway), the output and one log-sum-exp per query: O(T).
    Backward rebuilds each block's keys and mask and lets the flash backward kernel
    recompute its probabilities from the log-sum-exp, so nothing is computed twice except
    those masks and gathers: no second forward as checkpointing would need.
    """

    @staticmethod
    def forward(ctx, q, k, v, subtree_end, offset: int, block: int):
        Lq = q.shape[2]
        out = torch.empty_like(q)
        lse = None
        for qs in range(offset, offset + Lq, block):
            qe = min(offset + Lq, qs + block)
            kb, vb, mask, _ = _block_keys(subtree_end, qs, qe, k, v)
            o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, qs - offset:qe - offset], kb, vb, 0.0, False, attn_mask=mask)
            if lse is None:
                lse = torch.empty(q.shape[:3], dtype=l.dtype, device=q.device)
            out[:, :, qs - offset:qe - offset] = o
            lse[:, :, qs - offset:qe - offset] = l
        ctx.save_for_backward(q, k, v, subtree_end, out, lse)
        ctx.offset, ctx.block = offset, block
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, subtree_end, out, lse = ctx.saved_tensors
        offset, block, Lq = ctx.offset, ctx.block, q.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for qs in range(offset, offset + Lq, block):
            qe = min(offset + Lq, qs + block)
            sl = slice(qs - offset, qe - offset)
            kb, vb, mask, gather = _block_keys(subtree_end, qs, qe, k, v)
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[:, :, sl].contiguous(), q[:, :, sl], kb, vb, out[:, :, sl], lse[:, :, sl], 0.0, False,
                attn_mask=mask)
            dq[:, :, sl] = gq
            if gather is None:
                dk[:, :, :qe] += gk
                dv[:, :, :qe] += gv
            else:  # padded key slots are masked out everywhere, so their gradient is 0
                dk.scatter_add_(2, gather, gk)
                dv.scatter_add_(2, gather, gv)
        return dq, dk, dv, None, None, None


def _expand_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: repeat each KV head for the query heads that share it."""
    if k.shape[1] == q.shape[1]:
        return k, v
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"tree attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


class SdpaTreeAttention:
    """Query-blocked SDPA over each block's reachable keys, its backward recomputing each block.

    Memory. Left to autograd, each block keeps its gathered keys and values and its mask
    for backward: K x d and block x K values with K up to the path depth, T^2 over a long path
    (8.8 GB at 32K tokens for the tiny model). With ``recompute=True`` (the default) nothing
    per block is kept: on CPU a flash-style autograd function (``_FlashTreeAttention``) keeps
    the output and one log-sum-exp per query and rebuilds each block's keys and mask in
    backward, where the flash kernel recomputes the probabilities; elsewhere each block runs
    under activation checkpointing (one more forward per block). Either way memory is linear
    in the row length. ``recompute=False`` leaves it to autograd (short rows only).

    Chunks. Called with fewer queries than keys (``q`` [B, H, Lq, D], ``k`` [B, H, S, D]),
    the queries are rows [S - Lq, S) of the row and the keys rows [0, S): the last chunk of a
    long row attending to its earlier chunks' keys (see :mod:`gyre_hpc.trees.chunked`).
    """

    def __init__(self, subtree_end: torch.Tensor, block: int = 128, recompute: bool = True):
        if block < 1:
            raise ValueError(f"SdpaTreeAttention block={block} must be >= 1")
        self.subtree_end, self.block, self.recompute = subtree_end, block, recompute

    @property
    def largest_mask_block(self) -> tuple[int, ...]:
        """Shape [B, 1, queries, keys] of the largest block mask the row needs (never T x T)."""
        B, L = self.subtree_end.shape
        largest: tuple[int, ...] = ()
        for qs in range(0, L, self.block):
            qe = min(L, qs + self.block)
            n_keys = int((self.subtree_end[:, :qe] > qs).sum(dim=1).max())
            if not largest or (qe - qs) * n_keys > largest[2] * largest[3]:
                largest = (B, 1, qe - qs, n_keys)
        return largest

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        Lq, S = q.shape[2], k.shape[2]
        if Lq > S or S > self.subtree_end.shape[1]:
            raise ValueError(
                f"tree attention over a row of {self.subtree_end.shape[1]} tokens: got {Lq} queries and "
                f"{S} keys (queries must be the last of the keys, no more keys than the row)")
        k, v = _expand_kv_heads(q, k, v)
        offset = S - Lq
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        if needs_grad and self.recompute and q.device.type == "cpu":
            return _FlashTreeAttention.apply(q, k, v, self.subtree_end, offset, self.block)
        checkpointed = needs_grad and self.recompute
        outs = []
        for qs in range(offset, S, self.block):
            qe = min(S, qs + self.block)
            args = (self.subtree_end, qs, qe, q[:, :, qs - offset:qe - offset], k[:, :, :qe], v[:, :, :qe])
            if checkpointed:
                outs.append(checkpoint(_attend_block, *args, use_reentrant=False))
            else:
                outs.append(_attend_block(*args))
        return torch.cat(outs, dim=2)


@functools.cache
def _compiled_flex():
    """flex_attention is only fast compiled; compile once per process, on first GPU use.

    Rows differ in length; torch.compile's default marks the length dynamic after the first
    recompile. Collating with ``pad_to=train.row_tokens`` avoids even that one.
    """
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


class FlexTreeAttention:
    """flex_attention with a BlockMask from the interval test, built once per batch (or chunk).

    With ``q_len`` < ``kv_len`` the queries are rows [kv_len - q_len, kv_len): a chunk of a long
    row over its earlier chunks' keys. flex_attention keeps only the output and the per-query
    log-sum-exp for backward, so its memory is linear in the row length.
    """

    def __init__(self, subtree_end: torch.Tensor, compile: bool | None = None,
                 q_len: int | None = None, kv_len: int | None = None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.subtree_end = subtree_end
        B, L = subtree_end.shape
        kv_len = L if kv_len is None else kv_len
        q_len = kv_len if q_len is None else q_len
        offset = kv_len - q_len

        def tree_mask(b, h, q_idx, kv_idx):
            q_row = q_idx + offset
            return (kv_idx <= q_row) & (q_row < subtree_end[b, kv_idx])

        self.block_mask = create_block_mask(tree_mask, B, None, q_len, kv_len, device=subtree_end.device)
        use_compiled = subtree_end.device.type == "cuda" if compile is None else compile
        self._flex = _compiled_flex() if use_compiled else flex_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._flex(q, k, v, block_mask=self.block_mask, enable_gqa=k.shape[1] != q.shape[1])


def path_segments(positions: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(start, end, keys) of each run of consecutive tokens on one path in a depth-first row.

    ``positions``: each token's depth along its own path. In depth-first order a token's
    ancestor at depth d is the last token at depth d before it, and a token one deeper than
    the token before it is that token's child; so a run of such tokens shares its ancestors,
    and ``keys`` lists the run's path by position (row indices of depths 0..the run's last).
    """
    path = np.zeros(int(positions.max(initial=0)) + 1, dtype=np.int64)
    out: list[tuple[int, int, np.ndarray]] = []
    start, path_len = 0, 0
    for i in range(1, len(positions) + 1):
        if i < len(positions) and positions[i] == positions[i - 1] + 1:
            continue
        depth = int(positions[start])
        if depth > path_len:
            raise ValueError(f"row token {start} is at depth {depth} with no token at depth {depth - 1} "
                             "on the path before it: not a depth-first row of paths")
        path[depth:depth + i - start] = np.arange(start, i)
        path_len = depth + i - start
        out.append((start, i, path[:depth + i - start].copy()))
        start = i
    return out


class InvariantTreeAttention:
    """Tree attention through ``models.invariant.attention``: the engine's numbers, bit for bit.

    The engine computed each sampled token's logits with its keys at positions 0..its own,
    each sum taken in position order. Here each path segment (``path_segments``) gathers its
    path's keys in position order and calls the same kernel, so a token's attention is the
    same function of the same vectors: which tokens share its row, its micro-batch or a chunk
    does not enter. Called with fewer queries than keys, the queries are the last rows (a
    chunk of a long row, see ``trees.chunked``). Under autograd the kernel keeps only its
    inputs and recomputes plain attention for the gradient, so memory stays linear in the row.
    """

    def __init__(self, position_ids: torch.Tensor):
        self.position_ids = position_ids
        self.plans = [path_segments(row) for row in position_ids.cpu().numpy()]
        self._masks: dict[tuple[int, int, int], inv.KeyMask] = {}   # shared by the layers

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        Lq, S = q.shape[2], k.shape[2]
        if Lq > S or S > self.position_ids.shape[1]:
            raise ValueError(f"tree attention over a row of {self.position_ids.shape[1]} tokens: got {Lq} queries "
                             f"and {S} keys (queries must be the last of the keys, no more keys than the row)")
        offset = S - Lq
        k, v = _expand_kv_heads(q, k, v)
        rows = []
        for b, plan in enumerate(self.plans):
            parts = []
            for s, e, keys in plan:
                if e <= offset or s >= S:
                    continue
                s0, e0 = max(s, offset), min(e, S)
                if len(keys) == 1:       # a lone root token sees only itself: its value, exactly
                    parts.append(v[b:b + 1, :, s0:e0])
                    continue
                idx = torch.from_numpy(keys[:len(keys) - (e - e0)]).to(k.device)
                pos = self.position_ids[b:b + 1, s0:e0]
                mask = self._masks.get((b, s0, e0))
                if mask is None:
                    mask = self._masks[(b, s0, e0)] = inv.KeyMask(pos, 1)
                parts.append(inv.attention(q[b:b + 1, :, s0 - offset:e0 - offset], k[b:b + 1, :, idx],
                                           v[b:b + 1, :, idx], pos, mask))
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)


def tree_attention(backend: str, subtree_end: torch.Tensor, needs_grad: bool = True, block: int = 128,
                   q_len: int | None = None, kv_len: int | None = None, position_ids: torch.Tensor | None = None):
    """The attention_fn for one packed batch (or one chunk of it), by ``train.attention`` name."""
    name = resolve_backend(backend, subtree_end.device, needs_grad)
    if name == "flex":
        return FlexTreeAttention(subtree_end, q_len=q_len, kv_len=kv_len)
    if name == "invariant":
        if position_ids is None:
            raise ValueError("tree_attention('invariant') needs the rows' position_ids")
        return InvariantTreeAttention(position_ids[:, :subtree_end.shape[1]])
    return SdpaTreeAttention(subtree_end, block=block)

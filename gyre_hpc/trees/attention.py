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
  tree rather than the row length. The masks depend only on the row layout, so they are
  built once per batch and shared by every layer; kept for backward they total T x K
  bools. ``recompute_masks=True`` instead runs each block under activation checkpointing,
  so only one block's mask and gathered keys exist at a time, for about 1.5x the
  attention time (measured on this CPU). The CPU path.
* ``auto``: flex on CUDA, sdpa elsewhere.

Both are ``attention_fn(q, k, v)`` objects for :class:`gyre_hpc.models.tiny_lm.TinyLM`,
built once per batch and shared by every layer.
"""
from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Backend = Literal["auto", "sdpa", "flex"]
BACKENDS = ("auto", "sdpa", "flex")


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


def _attend_block(subtree_end: torch.Tensor, q_start: int, q_end: int, key_index: torch.Tensor,
                  key_valid: torch.Tensor, mask: torch.Tensor | None,
                  q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    B, H, _, D = k.shape
    gather = key_index[:, None, :, None].expand(B, H, key_index.shape[1], D)
    if mask is None:
        mask = tree_mask_block(subtree_end, q_start, q_end, key_index, key_valid)
    return F.scaled_dot_product_attention(q, k.gather(2, gather), v.gather(2, gather), attn_mask=mask)


class SdpaTreeAttention:
    """Query-blocked SDPA over each block's reachable keys; records the largest mask block."""

    def __init__(self, subtree_end: torch.Tensor, block: int = 128, recompute_masks: bool = False):
        if block < 1:
            raise ValueError(f"SdpaTreeAttention block={block} must be >= 1")
        self.subtree_end, self.block, self.recompute_masks = subtree_end, block, recompute_masks
        self.largest_mask_block: tuple[int, ...] = ()
        L = subtree_end.shape[1]
        # Keys and masks depend only on the row layout: once per batch, shared by all layers.
        self._blocks = []
        for qs in range(0, L, block):
            qe = min(L, qs + block)
            index, valid = tree_key_index(subtree_end, qs, qe)
            mask = None if recompute_masks else tree_mask_block(subtree_end, qs, qe, index, valid)
            self._blocks.append((qs, qe, index, valid, mask))
            shape = (subtree_end.shape[0], 1, qe - qs, index.shape[1])
            largest = self.largest_mask_block
            if not largest or shape[2] * shape[3] > largest[2] * largest[3]:
                self.largest_mask_block = shape

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        L = q.shape[2]
        if k.shape[2] != L or L != self.subtree_end.shape[1]:
            raise ValueError(
                f"tree attention expects no KV cache and {self.subtree_end.shape[1]} tokens: "
                f"got {L} queries, {k.shape[2]} keys")
        outs = []
        for qs, qe, index, valid, mask in self._blocks:
            args = (self.subtree_end, qs, qe, index, valid, mask, q[:, :, qs:qe], k[:, :, :qe], v[:, :, :qe])
            if self.recompute_masks and torch.is_grad_enabled():
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
    """flex_attention with a BlockMask from the interval test, built once per batch."""

    def __init__(self, subtree_end: torch.Tensor, compile: bool | None = None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.subtree_end = subtree_end
        B, L = subtree_end.shape

        def tree_mask(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < subtree_end[b, kv_idx])

        self.block_mask = create_block_mask(tree_mask, B, None, L, L, device=subtree_end.device)
        use_compiled = subtree_end.device.type == "cuda" if compile is None else compile
        self._flex = _compiled_flex() if use_compiled else flex_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._flex(q, k, v, block_mask=self.block_mask)


def tree_attention(backend: str, subtree_end: torch.Tensor, needs_grad: bool = True, block: int = 128):
    """The attention_fn for one packed batch, by ``train.attention`` name."""
    name = resolve_backend(backend, subtree_end.device, needs_grad)
    if name == "flex":
        return FlexTreeAttention(subtree_end)
    return SdpaTreeAttention(subtree_end, block=block)

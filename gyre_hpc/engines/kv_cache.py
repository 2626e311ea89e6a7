"""TorchEngine's KV cache: one batch-major buffer per layer, one row per running sequence.

Layout: ``k[layer]`` and ``v[layer]`` are ``[rows, Hkv, capacity, Dh]``. Running sequences
own rows ``0..n-1`` (kept compact), so the batch's keys are the *view*
``k[layer][:n, :, :s_max]``: decode attention reads the cache where it lies, and each new
token's key/value is written once, into its own row at its own position. Nothing is copied
per step (the old engine gathered every sequence's cache into a padded tensor and the model
concatenated it again, ~70% of a 16-stream decode step).

Why rows of one buffer and not paged blocks (vLLM): on CPU, SDPA over a strided view of
one buffer is the fastest read we have (head-major measured 1.2 ms against 1.8 ms
token-major for 16 x 600 tokens at one thread, the bound being memory bandwidth), while
attention over scattered blocks would need a gather (the very copy we remove) or a custom
kernel. The price is memory: the buffer holds ``rows x longest context``, so a batch that
mixes one very long context with short ones pads the short rows. Capacity and rows grow by
doubling (amortised O(1) copies per token) and the buffers are released when the last
sequence leaves.

Why zeros and not ``empty``: padded key positions are masked, but a masked score is
``q.k - inf``; a NaN left in uninitialised memory would survive that and poison the row.

Grouped-query attention: the cache stores the model's ``Hkv`` key/value heads; query head
``h`` reads kv head ``h // (Hq / Hkv)`` (HF ``repeat_kv`` order). In decode the ``G`` query
heads of a group are folded into the query-length axis, so no key is ever expanded.

Chunked prefill: each chunk attends causally to itself and fully to the cached past, with no
mask at all: two attention passes (past, no mask; chunk, ``is_causal``) merged by their
log-sum-exp. The CPU flash kernel hands out that log-sum-exp; elsewhere the chunk attends to
a view of past + chunk under a lower-right causal bias (untested here: no GPU in CI).

An invariant cache (``invariant=True``, TorchEngine's default) attends through
``models.invariant.attention`` over the row's keys 0..position, the same function the trainer's
tree attention calls, so a token's output does not depend on the batch, the chunking or
whether its keys were prefilled here, retained or migrated. It stores each layer's keys as
K^T (``[rows, Hkv, Dh, capacity]``; ``k[layer]`` is the transposed view, so every other method
reads and writes it as above): the kernel sums a query's scores over rows of K^T, and reads
them, and the values, where they lie for the batch's rows, never copied per step. Capacity is
a multiple of its key block (the kernels are compiled per row length).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gyre_hpc.models import invariant as inv


class SlotKVCache:
    """Per-layer ``[rows, Hkv, capacity, Dh]`` buffers; ``lengths[row]`` tokens are valid in each row."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_rows: int = 32, max_tokens: int = 1 << 30,
                 invariant: bool = False):
        if min(n_layers, n_kv_heads, head_dim, max_rows, max_tokens) < 1:
            raise ValueError(f"SlotKVCache: n_layers={n_layers}, n_kv_heads={n_kv_heads}, head_dim={head_dim}, "
                             f"max_rows={max_rows}, max_tokens={max_tokens} must all be >= 1")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.invariant = invariant
        self.memo: dict = {}   # the invariant kernels' masks and index lists, kept from forward to forward
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.lengths: list[int] = []

    # -- shape ----------------------------------------------------------------------------
    @property
    def n_rows(self) -> int:
        return len(self.lengths)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2] if self.k else 0

    @property
    def allocated_rows(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def _resize(self, rows: int, capacity: int) -> None:
        n, old_cap = self.n_rows, self.capacity
        # A multiple of the invariant kernels' key block (when the bound allows): they are
        # compiled per row length, so lengths stay few.
        capacity = max(capacity, min(self.max_tokens, inv.round_up(capacity, inv.KEY_BLOCK)))
        shape = (rows, self.n_kv_heads, capacity, self.head_dim)
        fresh = [[self._zeros(shape, transposed=(i == 0 and self.invariant)) for _ in range(self.n_layers)]
                 for i in range(2)]
        for old, new in zip((self.k, self.v), fresh):
            for o, nw in zip(old, new):
                nw[:n, :, :old_cap] = o[:n]
        self.k, self.v = fresh

    def _zeros(self, shape: tuple, transposed: bool) -> torch.Tensor:
        """A zero buffer of ``shape``; ``transposed``: stored as its last two dims swapped."""
        if not transposed:
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        return torch.zeros(*shape[:-2], shape[-1], shape[-2], dtype=self.dtype, device=self.device).transpose(-1, -2)

    def reserve(self, tokens: int) -> None:
        """Make every row hold at least ``tokens`` tokens (capacity doubles, up to ``max_tokens``)."""
        if tokens > self.max_tokens:
            raise ValueError(f"SlotKVCache.reserve({tokens}): beyond max_tokens={self.max_tokens}")
        if tokens > self.capacity and self.k:
            self._resize(self.allocated_rows, min(self.max_tokens, max(tokens, 2 * self.capacity)))

    def add_row(self, tokens: int) -> int:
        """A new row (length 0) with room for ``tokens``; returns its index."""
        if self.n_rows >= self.max_rows:
            raise ValueError(f"SlotKVCache: all max_rows={self.max_rows} rows are in use")
        if not self.k:
            self._resize(1, min(self.max_tokens, max(tokens, 256)))
        elif self.n_rows == self.allocated_rows:
            self._resize(min(self.max_rows, 2 * self.allocated_rows), self.capacity)
        self.reserve(tokens)
        self.lengths.append(0)
        return self.n_rows - 1

    def remove_row(self, row: int) -> int | None:
        """Free ``row``; the last row moves into it (one copy of one sequence) to keep rows
        compact. Returns the moved row's old index, or None when ``row`` was the last."""
        last = self.n_rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"SlotKVCache.remove_row({row}): rows are 0..{last}")
        moved = None
        if row != last:
            n = self.lengths[last]
            for bufs in (self.k, self.v):
                for buf in bufs:
                    buf[row, :, :n] = buf[last, :, :n]
            self.lengths[row] = n
            moved = last
        self.lengths.pop()
        if not self.lengths:  # nothing running: give the memory back
            self.k, self.v = [], []
        return moved

    # -- whole sequences (migration) --------------------------------------------------------
    def read(self, row: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """A copy of the row's cache, per layer (k, v) token-major ``[length, Hkv, Dh]``.
        A copy, not a view: the row is reused once its sequence leaves."""
        n = self.lengths[row]
        # clone, not contiguous(): with one kv head the transposed view already counts as
        # contiguous, and contiguous() would hand out the row itself.
        copy = lambda t: t[row, :, :n].transpose(0, 1).clone(memory_format=torch.contiguous_format)  # noqa: E731
        return tuple((copy(k), copy(v)) for k, v in zip(self.k, self.v))

    def write(self, row: int, kv) -> None:
        """Fill an empty row from per-layer token-major (k, v) ``[length, Hkv, Dh]``."""
        if len(kv) != self.n_layers:
            raise ValueError(f"SlotKVCache.write: {len(kv)} layers, the cache has {self.n_layers}")
        n = int(kv[0][0].shape[0])
        self.reserve(n + 1)
        for (k, v), kb, vb in zip(kv, self.k, self.v):
            kb[row, :, :n] = k.transpose(0, 1)
            vb[row, :, :n] = v.transpose(0, 1)
        self.lengths[row] = n

    # -- model hooks (contract: attend(layer, q, k, v)) -------------------------------------
    def prefill(self, row: int, n_new: int) -> "PrefillAttention":
        """The hook for one forward of ``n_new`` tokens of ``row``, after its cached past."""
        self.reserve(self.lengths[row] + n_new + 1)  # + 1: room for the next decode write
        return PrefillAttention(self, row, self.lengths[row], n_new)

    def decode(self) -> "DecodeAttention":
        """The hook for one forward of one new token of every row, in row order."""
        self.reserve(max(self.lengths) + 1)
        return DecodeAttention(self)


class PrefillAttention:
    def __init__(self, cache: SlotKVCache, row: int, start: int, n_new: int):
        self.cache, self.row, self.start, self.n_new = cache, row, start, n_new
        self.key_mask: inv.KeyMask | None = None   # one per forward: every layer attends from these positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c, row, start = self.cache, self.row, self.start
        T = q.shape[2]
        kb, vb = c.k[layer], c.v[layer]
        kb[row, :, start:start + T] = k[0]
        vb[row, :, start:start + T] = v[0]
        if c.invariant:   # the whole row: the mask hides what lies past each query
            if self.key_mask is None:
                self.key_mask = inv.KeyMask.causal(start, T, q.shape[1] // k.shape[1], q.device, c.memo)
            km = self.key_mask
            return inv.attention(q, kb[row:row + 1], vb[row:row + 1], km.positions, km)
        groups = q.shape[1] // k.shape[1]
        if start == 0:
            return F.scaled_dot_product_attention(q, _expand(k, groups), _expand(v, groups), is_causal=True)
        if q.device.type != "cpu":
            from torch.nn.attention.bias import causal_lower_right

            keys, values = kb[row:row + 1, :, :start + T], vb[row:row + 1, :, :start + T]
            return F.scaled_dot_product_attention(q, _expand(keys, groups), _expand(values, groups),
                                                  attn_mask=causal_lower_right(T, start + T))
        return _past_then_causal(q, kb[row:row + 1, :, :start], vb[row:row + 1, :, :start], k, v, groups)

    def commit(self) -> None:
        self.cache.lengths[self.row] = self.start + self.n_new


class DecodeAttention:
    def __init__(self, cache: SlotKVCache):
        self.cache = cache
        self.key_mask: inv.KeyMask | None = None   # one per forward: every layer attends from these positions
        n = cache.n_rows
        self.pos = torch.tensor(cache.lengths, device=cache.device)
        self.rows = torch.arange(n, device=cache.device)
        self.span = max(cache.lengths) + 1
        self.mask = None
        self.uniform = min(cache.lengths) == max(cache.lengths)
        if not self.uniform:
            cols = torch.arange(self.span, device=cache.device)
            self.mask = (cols[None, :] <= self.pos[:, None])[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, Hq, T, Dh = q.shape
        if T != 1:
            raise ValueError(f"DecodeAttention: one new token per row, got T={T}")
        kb, vb = self.cache.k[layer], self.cache.v[layer]
        if self.uniform:   # a slice write: cheaper than index_put (always so for one stream)
            kb[:B, :, self.span - 1] = k[:, :, 0]
            vb[:B, :, self.span - 1] = v[:, :, 0]
        else:
            kb[self.rows, :, self.pos] = k[:, :, 0]
            vb[self.rows, :, self.pos] = v[:, :, 0]
        if self.cache.invariant:   # the batch's whole rows: the mask hides what lies past each query
            if self.key_mask is None:
                self.key_mask = inv.KeyMask(self.pos[:, None], Hq // k.shape[1], self.cache.memo)
            km = self.key_mask
            return inv.attention(q, kb[:B], vb[:B], km.positions, km)
        hkv = k.shape[1]
        # The G query heads of a kv group become G query rows against that group's keys.
        out = F.scaled_dot_product_attention(q.reshape(B, hkv, Hq // hkv, Dh), kb[:B, :, :self.span],
                                             vb[:B, :, :self.span], attn_mask=self.mask)
        return out.reshape(B, Hq, 1, Dh)

    def commit(self) -> None:
        self.cache.lengths = [n + 1 for n in self.cache.lengths]


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _past_then_causal(q, k_past, v_past, k_new, v_new, groups: int) -> torch.Tensor:
    """softmax over [past | new] with causal new, from two passes merged by log-sum-exp."""
    B, Hq, T, Dh = q.shape
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    hkv = k_past.shape[1]
    o_past, l_past = flash(q.reshape(B, hkv, groups * T, Dh), k_past, v_past, 0.0, False)[:2]
    o_past, l_past = o_past.reshape(B, Hq, T, Dh), l_past.reshape(B, Hq, T)
    o_new, l_new = flash(q, _expand(k_new, groups), _expand(v_new, groups), 0.0, True)[:2]
    top = torch.maximum(l_past, l_new)
    w_past = torch.exp(l_past - top)[..., None]
    w_new = torch.exp(l_new - top)[..., None]
    # The log-sum-exps are float32 whatever the inputs; the weights are formed there and the
    # output returns in the model's dtype.
    return ((o_past * w_past + o_new * w_new) / (w_past + w_new)).to(q.dtype)

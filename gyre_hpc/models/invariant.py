"""Batch- and cache-invariant kernels: a token's logits are one number wherever they are computed.

Why: the engine's behaviour logprobs are the denominators of the loss's importance ratio
(``trees.loss``). If the engine computes a token's logprob in a batch of 16 and the trainer
computes it inside a packed tree, float32 sums taken in different orders differ in their last
bits, and a strictly on-policy step has ratios != 1 that no policy change caused. The same
holds inside the engine: a retained or migrated KV cache, another prefill chunking or other
requests in the batch change the order of the sums. These kernels fix every reduction order
so that it depends only on the token's own context, never on what it was computed beside
(the idea of vLLM's and SGLang's batch-invariant kernels, here on CPU):

* **Matrix products** run with their rows padded to a multiple of ``ROW_TILE`` (4) and at least
  ``MIN_COLUMNS`` (16) columns. Seen on this project's CPUs (MKL and oneDNN on AVX-512, and
  with torch and MKL held to AVX2 or the default ISA): a product whose row count is 1-3, 5-7 or
  9-11, or whose column count is under ~10, takes a kernel whose sums run in another order;
  row counts of 4, 8 and 12 or more, with 16 or more columns, all compute each element with one
  accumulation order for a given reduction length K, however many rows are beside it. So a
  row's result is a function of that row alone. ``tests/models/test_invariant.py`` checks
  exactly this on the machine it runs on, so a machine whose BLAS behaves otherwise fails
  loudly instead of training on silently different numbers.
* **Attention** sums with ``embedding_bag`` (FBGEMM's kernels): a bag sum is, per output
  element, one fused multiply-add after another over the bag's terms in their order, from 0,
  whatever other bags and lanes share the call; nothing is summed across vector lanes, so the
  AVX2 and AVX-512 kernels give the same bits too. A score is such a chain over Dh, a query's
  output and its softmax denominator are chains over its keys in position order. Keys past a
  query's position carry weight exact 0 and add nothing (``fma(0, v, acc) == acc``), so a
  query's result depends only on its keys 0..position, never on the padding, the batch, the
  chunk it came in or where its KV was computed. The softmax maximum is exact in any order
  and ``exp`` is elementwise. Operands are contiguous: a strided one sends torch to its own
  loop, which multiplies and adds with two roundings.
* **SiLU** is ``x / (1 + exp(-x))``: torch's fused ``silu`` and ``sigmoid`` give another last
  bit for elements that fall in a vector loop's scalar tail (seen here: ~4% of tail elements),
  so an element's value depends on its place in the tensor. ``exp``, ``rsqrt``, products and
  sums of two numbers are the same in the tail as in the body.

RMSNorm (a mean over one row), rotary positions (computed per element in float64),
embeddings and ``log_softmax`` over a row are invariant as they are.

What it costs: small products padded to 4 rows, attention sums in bag kernels (a decode
step reads K^T and V where the engine's cache holds them), ``exp`` and the masks as separate
passes; ``bench engines`` reports the tokens/s ratio against ``native``. What it does not
cover: GPU kernels and bf16 (their gap is measured per step, not assumed away).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 4       # rows of every product are padded to a multiple of this
MIN_COLUMNS = 16   # the fewest columns of any product
KEY_BLOCK = 64     # key counts read are rounded up to this: bag kernels are compiled per row width
QUERY_ROWS = 128   # query rows per tile: its scores stay in L2 (any value gives the same bits)
LANES = 16         # a by-keys tile's query rows are padded to a multiple of this (a vector)
KEYS_FIRST = 32    # tiles of at least this many query rows per kv head sum by keys
MAX_KEPT_INDICES = 1 << 22   # bag index lists up to this size are kept for a forward's layers

def round_up(n: int, tile: int) -> int:
    """``n`` rounded up to a whole number of ``tile`` (0 stays 0)."""
    return -(-n // tile) * tile


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row is a function of its input row alone.

    Rows are padded with zeros to a multiple of ``ROW_TILE`` (at least one tile), so the
    product never takes an odd-row kernel; the padding rows are dropped from the result.
    """
    if weight.shape[0] < MIN_COLUMNS:
        raise ValueError(f"invariant.linear: {weight.shape[0]} output features; the invariant kernels need "
                         f">= {MIN_COLUMNS} (pad the layer)")
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    padded = max(ROW_TILE, round_up(m, ROW_TILE))
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))
    return F.linear(rows, weight, bias)[:m].reshape(*lead, weight.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from ``exp`` and a division, the same bits at every place of the tensor."""
    return x / (1.0 + torch.exp(-x))


class KeyMask:
    """What the queries of one forward read, built once and shared by its layers (they all
    attend from the same positions). Per query tile: the keys it reads (rounded up to
    ``KEY_BLOCK``), an additive bias (0 / -1e30, for the maximum) and a factor (1 / 0, for the
    sums), broadcast over the kv heads; and the index lists of the bag sums. ``positions``: the
    queries' [B, T] positions it was built from."""

    def __init__(self, q_pos: torch.Tensor, groups: int):
        B, T = q_pos.shape
        self.positions = q_pos
        self.row_pos = q_pos[:, None, :].expand(B, groups, T).reshape(B, groups * T)
        self._tiles: dict[tuple, tuple] = {}
        self._bags: dict[tuple, tuple] = {}

    def tile(self, r0: int, r1: int, keys: int, dtype: torch.dtype, by_keys: bool):
        """(keys read, bias, visible) for rows [r0, r1) of ``keys`` available, in ``dtype``:
        [B, 1, rows, keys], or by keys [B, 1, keys, rows padded to LANES]."""
        key = (r0, r1, keys, dtype, by_keys)
        if key not in self._tiles:
            pos = self.row_pos[:, r0:r1]
            span = min(keys, round_up(int(pos.max()) + 1, KEY_BLOCK))           # keys any row here sees
            key_at = torch.arange(span, device=pos.device)
            if by_keys:   # padding rows sit at position 0: they see key 0 and are dropped
                pos = F.pad(pos, (0, round_up(r1 - r0, LANES) - (r1 - r0)))
                visible = (key_at[:, None] <= pos[:, None, :]).to(dtype)[:, None]
            else:
                visible = (key_at <= pos[..., None]).to(dtype)[:, None]
            self._tiles[key] = (span, (visible - 1.0) * 1e30, visible)
        return self._tiles[key]

    def bags(self, groups: int, rows: int, stride: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, offsets) of ``groups x rows`` bags, each of ``length`` consecutive table
        rows starting at ``group * stride`` (``stride`` 0: row 0, ``length`` times). Kept for
        the forward's other layers when small."""
        key = (groups, rows, stride, length)
        bags = self._bags.get(key)
        if bags is None:
            device = self.positions.device
            along = torch.arange(length, device=device) if stride else torch.zeros(length, dtype=torch.long, device=device)
            indices = (torch.arange(groups, device=device)[:, None, None] * stride + along).expand(groups, rows, length)
            bags = (indices.reshape(-1), torch.arange(groups * rows, device=device) * length)
            if indices.numel() <= MAX_KEPT_INDICES:
                self._bags[key] = bags
        return bags


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              mask: KeyMask | None = None) -> torch.Tensor:
    """Softmax attention of each query over the keys at positions 0..its own, order-invariant.

    ``q`` [B, Hq, T, Dh]; ``k``, ``v`` [B, Hkv, S, Dh] with each row's keys at their absolute
    positions 0..S-1 (keys past a query's position may hold anything finite: they are masked);
    ``q_pos`` [B, T], the absolute position of each query. Query head h reads kv head
    h // (Hq / Hkv). Returns [B, Hq, T, Dh] in q's dtype. ``mask``: the ``KeyMask`` of
    ``q_pos`` when several layers attend from the same positions (built here otherwise).

    Every sum is a bag sum (``embedding_bag``, see the module docstring): a score is q . k
    over Dh, an output the probabilities times V over positions 0.., its denominator the
    probabilities over the same positions, each one fused multiply-add after another in that
    order. Tiles of few query rows per kv head (decode) sum by rows (``_by_rows``), tiles of
    many (prefill, the trainer) by keys (``_by_keys``): the same multiply-adds in the same
    order, so the same bits, arranged for the kernel's vector lanes.
    """
    B, Hq, T, Dh = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"invariant.attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    if q_pos.shape != (B, T):
        raise ValueError(f"invariant.attention: q_pos has shape {tuple(q_pos.shape)}, expected {(B, T)}")
    G = Hq // Hkv
    mask = mask if mask is not None else KeyMask(q_pos, G)
    # The G query heads of a kv group become G x T query rows against that group's keys.
    rows = (q * (1.0 / (Dh ** 0.5))).reshape(B * Hkv, G * T, Dh)
    # Under autograd (the trainer) the same arithmetic runs out of place.
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    for r0 in range(0, G * T, QUERY_ROWS):
        r1 = min(G * T, r0 + QUERY_ROWS)
        by_keys = r1 - r0 >= KEYS_FIRST
        span, bias, visible = mask.tile(r0, r1, k.shape[2], q.dtype, by_keys)
        outs.append((_by_keys if by_keys else _by_rows)(rows[:, r0:r1], k, v, span, bias, visible, mask, grad))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.reshape(B, Hq, T, Dh).to(q.dtype)


def _by_rows(rows, k, v, span, bias, visible, mask, grad) -> torch.Tensor:
    """One bag per query row: its scores sum the Dh rows of K^T (lanes: keys) weighted by
    its q; its output and denominator sum the rows of V and of 1s (lanes: Dh) weighted by its
    probabilities. ``k`` laid out as K^T (the engine's cache) is read where it lies when the
    tile reads most of it; otherwise the tile copies the K^T it reads. [BH, n, Dh]."""
    B, Hkv, S, Dh = k.shape
    BH, n = B * Hkv, rows.shape[1]
    keys_t = k.transpose(-1, -2)                                                   # [B, Hkv, Dh, S]
    if keys_t.is_contiguous() and 2 * span > S:
        table = keys_t.view(BH * Dh, S)
    else:
        table = keys_t[..., :span].contiguous().view(BH * Dh, span)
    idx, off = mask.bags(BH, n, Dh, Dh)
    scores = F.embedding_bag(idx, table, off, mode="sum", per_sample_weights=rows.contiguous().view(-1))
    p = _numerators(scores[:, :span].view(B, Hkv, n, span), bias, visible, grad, keys_dim=-1).view(-1)
    idx, off = mask.bags(BH, n, S, span)
    acc = F.embedding_bag(idx, v.contiguous().view(BH * S, Dh), off, mode="sum", per_sample_weights=p)
    idx, off = mask.bags(BH, n, 0, span)
    denom = F.embedding_bag(idx, v.new_ones(1, 1), off, mode="sum", per_sample_weights=p)
    return (acc / denom).view(BH, n, Dh)


def _by_keys(rows, k, v, span, bias, visible, mask, grad) -> torch.Tensor:
    """One bag per key for the scores (its K row weights the Dh rows of Q^T; lanes: query
    rows), then one bag per output column (a column of V, or 1s for the denominator, weights
    the rows of P^T: lanes again query rows). Rows are padded to ``LANES``. [BH, n, Dh]."""
    B, Hkv, S, Dh = k.shape
    BH, n = B * Hkv, rows.shape[1]
    lanes = visible.shape[-1]
    q_t = F.pad(rows, (0, 0, 0, lanes - n)).transpose(1, 2).contiguous().view(BH * Dh, lanes)
    idx, off = mask.bags(BH, span, Dh, Dh)
    scores = F.embedding_bag(idx, q_t, off, mode="sum", per_sample_weights=k[:, :, :span].contiguous().view(-1))
    p_t = _numerators(scores.view(B, Hkv, span, lanes), bias, visible, grad, keys_dim=-2)
    columns = torch.cat([v[:, :, :span].transpose(-1, -2), v.new_ones(B, Hkv, 1, span)], dim=2)  # V^T and 1s
    idx, off = mask.bags(BH, Dh + 1, span, span)
    out = F.embedding_bag(idx, p_t.view(BH * span, lanes), off, mode="sum",
                          per_sample_weights=columns.contiguous().view(-1)).view(BH, Dh + 1, lanes)
    return (out[:, :Dh, :n] / out[:, Dh:, :n]).transpose(1, 2)


def _numerators(scores: torch.Tensor, bias: torch.Tensor, visible: torch.Tensor, grad: bool,
                keys_dim: int) -> torch.Tensor:
    """exp(score - max over ``keys_dim``) for visible keys, exact 0 for the others, in a
    fresh contiguous tensor.

    Masked keys: -1e30 for the maximum, then a factor 0 (not exp(-inf): torch's exp takes a
    slow path for -inf and underflow). The exponent is clamped to [-80, 0]: a visible term
    below e^-80 of the largest counts as e^-80, which no float32 sum of terms including 1 (the
    largest) can tell apart from 0. Without autograd the steps after the first run in place
    (the same elementwise kernels, so the same bits)."""
    s = scores + bias
    if grad:
        top = s.amax(dim=keys_dim, keepdim=True).detach()                      # exact; softmax ignores it
        return torch.exp((s - top).clamp(-80.0, 0.0)) * visible
    top = s.amax(dim=keys_dim, keepdim=True)
    return s.sub_(top).clamp_(-80.0, 0.0).exp_().mul_(visible)


def causal_positions(batch: int, start: int, length: int, device) -> torch.Tensor:
    """[B, T] positions start..start+T-1: a plain sequence after ``start`` cached tokens."""
    return torch.arange(start, start + length, device=device)[None].expand(batch, length)

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
* **Attention** reduces over keys in blocks of ``KEY_BLOCK`` aligned to absolute position 0:
  scores by one product over all keys, the maximum (exact in any order), ``exp`` (elementwise),
  each block's sum over a fixed ``KEY_BLOCK`` keys, then the blocks one after another
  (``in_order``, for the denominators and the values alike). Keys a query cannot see
  contribute exact zeros at the end
  of that scan, so a query's output depends only on its keys 0..position, never on the padding,
  the batch, the chunk it came in or where its KV was computed.
* **SiLU** is ``x / (1 + exp(-x))``: torch's fused ``silu`` and ``sigmoid`` give another last
  bit for elements that fall in a vector loop's scalar tail (seen here: ~4% of tail elements),
  so an element's value depends on its place in the tensor. ``exp``, ``rsqrt``, products and
  sums of two numbers are the same in the tail as in the body.

RMSNorm (a mean over one row), rotary positions (computed per element in float64),
embeddings and ``log_softmax`` over a row are invariant as they are.

What it costs: decode pads a step's rows to a multiple of 4 and each sequence's query heads to
4 rows of the score and value products, which run one key block at a time; ``bench engines`` reports the tokens/s ratio against ``native``. What it
does not cover: GPU kernels and bf16 (their gap is measured per step, not assumed away).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 4       # rows of every product are padded to a multiple of this
MIN_COLUMNS = 16   # the fewest columns of any product
KEY_BLOCK = 64     # keys summed in blocks of this many, aligned to position 0
QUERY_ROWS = 256   # query rows per score tile (memory only; any value gives the same bits)

def _round_up(n: int, tile: int) -> int:
    return max(tile, -(-n // tile) * tile)


def key_blocks_span(tokens: int) -> int:
    """``tokens`` rounded up to whole key blocks (0 stays 0): what a cache must hold for the
    block-aligned reduction to read whole blocks (engines.kv_cache sizes rows with it)."""
    return -(-tokens // KEY_BLOCK) * KEY_BLOCK


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
    padded = _round_up(m, ROW_TILE)
    if padded != m:
        rows = F.pad(rows, (0, 0, 0, padded - m))
    return F.linear(rows, weight, bias)[:m].reshape(*lead, weight.shape[0])


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from ``exp`` and a division, the same bits at every place of the tensor."""
    return x / (1.0 + torch.exp(-x))


class KeyMask:
    """Which keys each query row sees, per query tile, built once per forward and shared by its
    layers (they all attend from the same positions): an additive bias (0 / -1e30, for the
    maximum) and a factor (1 / 0, for the sums), each [B, 1, tile, keys], broadcast over the
    kv heads. ``positions`` are the queries' ([B, T]) it was built from."""

    def __init__(self, q_pos: torch.Tensor, groups: int):
        B, T = q_pos.shape
        self.positions = q_pos
        self.row_pos = q_pos[:, None, :].expand(B, groups, T).reshape(B, groups * T)
        self._tiles: dict[tuple, tuple] = {}

    def tile(self, r0: int, r1: int, n_blocks: int, dtype: torch.dtype = torch.float32):
        """(rows in the tile, blocks seen, bias, visible) for rows [r0, r1), in ``dtype``."""
        key = (r0, n_blocks, dtype)
        if key not in self._tiles:
            pos = self.row_pos[:, r0:r1]
            n = r1 - r0
            tile = _round_up(n, ROW_TILE)
            if tile != n:   # padding rows sit at position 0: they see key 0 and are dropped
                pos = F.pad(pos, (0, tile - n))
            nb = min(n_blocks, int(pos.max()) // KEY_BLOCK + 1)                 # blocks any row here sees
            key_at = torch.arange(nb * KEY_BLOCK, device=pos.device)
            visible = (key_at <= pos[..., None]).to(dtype)[:, None]             # [B, 1, tile, keys]
            self._tiles[key] = (tile, nb, (visible - 1.0) * 1e30, visible)
        return self._tiles[key]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              mask: KeyMask | None = None) -> torch.Tensor:
    """Softmax attention of each query over the keys at positions 0..its own, order-invariant.

    ``q`` [B, Hq, T, Dh]; ``k``, ``v`` [B, Hkv, S, Dh] with each row's keys at their absolute
    positions 0..S-1 (keys past a query's position may hold anything finite: they are masked);
    ``q_pos`` [B, T], the absolute position of each query. Query head h reads kv head
    h // (Hq / Hkv). Returns [B, Hq, T, Dh] in q's dtype. ``mask``: the ``KeyMask`` of
    ``q_pos`` when several layers attend from the same positions (built here otherwise).

    Products: scores as [rows, Dh] x [Dh, keys] (a dot over Dh each), values one key block at a
    time ([rows, KEY_BLOCK] x [KEY_BLOCK, Dh], batched over sequences and kv heads) added to
    the sum of the blocks before it, rows padded to ``ROW_TILE``. Both products read ``k`` and
    ``v`` where they lie (a slice of a KV cache's rows is a view here, never copied), and the
    probabilities are read in place as column slices. Key blocks past every query of a tile
    are skipped: they would add exact zeros at the end of the scan, so skipping them changes
    no bit.
    """
    B, Hq, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"invariant.attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    if q_pos.shape != (B, T):
        raise ValueError(f"invariant.attention: q_pos has shape {tuple(q_pos.shape)}, expected {(B, T)}")
    G, BH, KB = Hq // Hkv, B * Hkv, KEY_BLOCK
    mask = mask if mask is not None else KeyMask(q_pos, G)
    # The G query heads of a kv group become G x T query rows against that group's keys.
    rows = (q * (1.0 / (Dh ** 0.5))).reshape(BH, G * T, Dh)
    s_pad = _round_up(S, KB)
    if s_pad != S:
        k = F.pad(k, (0, 0, 0, s_pad - S))
        v = F.pad(v, (0, 0, 0, s_pad - S))
    d_out = max(Dh, MIN_COLUMNS)
    if d_out != Dh:                       # the value product needs >= MIN_COLUMNS columns too
        v = F.pad(v, (0, d_out - Dh))
    keys, values = k.reshape(BH, s_pad, Dh), v.reshape(BH, s_pad, d_out)
    # Under autograd (the trainer) the same arithmetic runs out of place.
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    n_rows = G * T
    for r0 in range(0, n_rows, QUERY_ROWS):
        r1 = min(n_rows, r0 + QUERY_ROWS)
        n = r1 - r0
        tile, nb, bias, visible = mask.tile(r0, r1, s_pad // KB, q.dtype)
        qt = rows[:, r0:r1] if tile == n else F.pad(rows[:, r0:r1], (0, 0, 0, tile - n))
        # One product over the keys the tile sees: each score is a dot over Dh, its order fixed
        # by Dh alone (the key count is the product's column count, which does not enter).
        scores = torch.bmm(qt, keys[:, :nb * KB].transpose(1, 2)).view(B, Hkv, tile, nb * KB)
        p = _numerators(scores, bias, visible, grad).view(BH, tile, nb * KB)
        denom = in_order(p.view(BH, tile, nb, KB).sum(-1), dim=2)               # [BH, tile]
        acc = torch.bmm(p[:, :, :KB], values[:, :KB])                           # [BH, tile, d_out]
        for j in range(1, nb):   # block j added to the sum of blocks 0..j-1: the in_order scan
            block = torch.bmm(p[:, :, j * KB:(j + 1) * KB], values[:, j * KB:(j + 1) * KB])
            acc = acc + block if grad else acc.add_(block)
        outs.append(acc[:, :n, :Dh] / denom[:, :n, None])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.reshape(B, Hq, T, Dh).to(q.dtype)


def _numerators(scores: torch.Tensor, bias: torch.Tensor, visible: torch.Tensor, grad: bool) -> torch.Tensor:
    """exp(score - max) for visible keys, exact 0 for the others.

    Masked keys: -1e30 for the maximum, then a factor 0 (not exp(-inf): torch's exp takes a
    slow path for -inf and underflow). The exponent is clamped to [-80, 0]: a visible term
    below e^-80 of the largest counts as e^-80, which no float32 sum of terms including 1 (the
    largest) can tell apart from 0. Without autograd the scores' buffer is reused in place
    (the same elementwise kernels, so the same bits)."""
    if grad:
        s = scores + bias
        top = s.amax(dim=-1, keepdim=True).detach()                            # exact; softmax ignores it
        return torch.exp((s - top).clamp(-80.0, 0.0)) * visible
    s = scores.add_(bias)
    top = s.amax(dim=-1, keepdim=True)
    return s.sub_(top).clamp_(-80.0, 0.0).exp_().mul_(visible)


def in_order(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` taken one slice after another, from the first: each addition
    rounds once, so trailing slices of zeros change no bit."""
    acc = blocks.select(dim, 0)
    for j in range(1, blocks.shape[dim]):
        acc = acc + blocks.select(dim, j)
    return acc


def causal_positions(batch: int, start: int, length: int, device) -> torch.Tensor:
    """[B, T] positions start..start+T-1: a plain sequence after ``start`` cached tokens."""
    return torch.arange(start, start + length, device=device)[None].expand(batch, length)

"""Batch- and cache-invariant kernels: a token's logits are one number wherever they are computed.

Why: the engine's behaviour logprobs are the denominators of the loss's importance ratio
(``trees.loss``). If the engine computes a token's logprob in a batch of 16 and the trainer
computes it inside a packed tree, float32 sums taken in different orders differ in their last
bits, and a strictly on-policy step has ratios != 1 that no policy change caused. The same
holds inside the engine: a retained or migrated KV cache, another prefill chunking or other
requests in the batch change the order of the sums. These kernels fix every reduction order
so that it depends only on the token's own context, never on what it was computed beside
(the idea of vLLM's and SGLang's batch-invariant kernels, here on CPU):

* **Matrix products** run with both output dimensions at least ``ROW_TILE`` and their rows
  padded to a multiple of it. Seen on the CPUs we test (oneDNN/MKL, AVX-512, AVX2 and the
  default ISA): a product with 1-7 rows or 1-9 columns takes a gemv-like kernel whose sums run
  in another order, while from ~8 up every row and column of a product of the same reduction
  length K is computed by one accumulation order, however many others are beside it. So a row's
  result is a function of that row alone. ``tests/models/test_invariant.py`` checks this on
  the machine it runs on.
* **Attention** reduces over keys in blocks of ``KEY_BLOCK`` aligned to absolute position 0:
  scores by one product over all keys, the maximum (exact in any order), ``exp`` (elementwise),
  each block's sum over a fixed ``KEY_BLOCK`` keys, then the blocks one after another
  (``cumsum``, a sequential scan). Keys a query cannot see contribute exact zeros at the end
  of that scan, so a query's output depends only on its keys 0..position, never on the padding,
  the batch, the chunk it came in or where its KV was computed.
* **SiLU** is ``x / (1 + exp(-x))``: torch's fused ``silu`` and ``sigmoid`` give another last
  bit for elements that fall in a vector loop's scalar tail (seen here: ~4% of tail elements),
  so an element's value depends on its place in the tensor. ``exp``, ``rsqrt``, products and
  sums of two numbers are the same in the tail as in the body.

RMSNorm (a mean over one row), rotary positions (computed per element in float64),
embeddings and ``log_softmax`` over a row are invariant as they are.

What it costs: decode pads a step's rows to 16 and each sequence's query heads to 16 rows of
the score product; ``bench engines`` reports the tokens/s ratio against ``native``. What it
does not cover: GPU kernels and bf16 (their gap is measured per step, not assumed away).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 16      # the fewest rows (and columns) of any product; rows padded to a multiple
KEY_BLOCK = 64     # keys summed in blocks of this many, aligned to position 0
QUERY_ROWS = 256   # query rows per score tile (memory only; any value gives the same bits)

NUMERICS = ("invariant", "native")


def check_numerics(name: str, where: str = "model.numerics") -> bool:
    """True for ``invariant``; refuses a name that is not one of ``NUMERICS``."""
    if name not in NUMERICS:
        raise ValueError(f"{where}={name!r}: valid choices are {', '.join(NUMERICS)}")
    return name == "invariant"


def _round_up(n: int, tile: int) -> int:
    return max(tile, -(-n // tile) * tile)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row is a function of its input row alone.

    Rows are padded with zeros to a multiple of ``ROW_TILE`` (at least one tile), so the
    product never takes the few-row kernel; the padding rows are dropped from the result.
    """
    if weight.shape[0] < ROW_TILE:
        raise ValueError(f"invariant.linear: {weight.shape[0]} output features; the invariant kernels need "
                         f">= {ROW_TILE} (pad the layer)")
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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Softmax attention of each query over the keys at positions 0..its own, order-invariant.

    ``q`` [B, Hq, T, Dh]; ``k``, ``v`` [B, Hkv, S, Dh] with each row's keys at their absolute
    positions 0..S-1 (keys past a query's position may hold anything finite: they are masked);
    ``q_pos`` [B, T], the absolute position of each query. Query head h reads kv head
    h // (Hq / Hkv). Returns [B, Hq, T, Dh] in q's dtype.
    """
    B, Hq, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"invariant.attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    if q_pos.shape != (B, T):
        raise ValueError(f"invariant.attention: q_pos has shape {tuple(q_pos.shape)}, expected {(B, T)}")
    G = Hq // Hkv
    # The G query heads of a kv group become G x T query rows against that group's keys.
    rows = q.reshape(B, Hkv, G * T, Dh)
    row_pos = q_pos[:, None, :].expand(B, G, T).reshape(B, 1, G * T)
    s_pad = _round_up(S, KEY_BLOCK)
    if s_pad != S:
        k = F.pad(k, (0, 0, 0, s_pad - S))
        v = F.pad(v, (0, 0, 0, s_pad - S))
    d_out = max(Dh, ROW_TILE)
    if d_out != Dh:                       # the value product needs >= ROW_TILE columns too
        v = F.pad(v, (0, d_out - Dh))
    n_blocks = s_pad // KEY_BLOCK
    key_at = torch.arange(s_pad, device=q.device)
    v_blocks = v.reshape(B, Hkv, n_blocks, KEY_BLOCK, d_out)
    scale = 1.0 / (Dh ** 0.5)
    outs = []
    n_rows = G * T
    for r0 in range(0, n_rows, QUERY_ROWS):
        r1 = min(n_rows, r0 + QUERY_ROWS)
        tile = _round_up(r1 - r0, ROW_TILE)
        qt, pos = rows[:, :, r0:r1], row_pos[:, :, r0:r1]
        if tile != r1 - r0:              # zero query rows at position 0: they see key 0 and are dropped
            qt = F.pad(qt, (0, 0, 0, tile - (r1 - r0)))
            pos = F.pad(pos, (0, tile - (r1 - r0)))
        scores = (qt @ k.transpose(-1, -2)) * scale                       # [B, Hkv, tile, s_pad]
        visible = key_at[None, None, None, :] <= pos[..., None]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.amax(-1, keepdim=True).detach()                      # exact; softmax does not depend on it
        p = torch.exp(scores - top).reshape(B, Hkv, tile, n_blocks, KEY_BLOCK)
        denom = p.sum(-1).cumsum(-1)[..., -1:]                            # [B, Hkv, tile, 1]
        per_block = p.transpose(2, 3) @ v_blocks                          # [B, Hkv, n_blocks, tile, d_out]
        acc = per_block.cumsum(2)[:, :, -1]                               # blocks in order, one after another
        outs.append((acc / denom)[:, :, :r1 - r0, :Dh])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.reshape(B, Hq, T, Dh).to(q.dtype)


def causal_positions(batch: int, start: int, length: int, device) -> torch.Tensor:
    """[B, T] positions start..start+T-1: a plain sequence after ``start`` cached tokens."""
    return torch.arange(start, start + length, device=device)[None].expand(batch, length)

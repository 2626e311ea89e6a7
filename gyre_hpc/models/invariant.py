"""Batch- and cache-invariant kernels: a token's logits are one number wherever they are computed.

Why: the engine's behaviour logprobs are the denominators of the loss's importance ratio
(``trees.loss``). If the engine computes a token's logprob in a batch of 16 and the trainer
computes it inside a packed tree, float32 sums taken in different orders differ in their last
bits, and a strictly on-policy step has ratios != 1 that no policy change caused. The same
holds inside the engine: a retained or migrated KV cache, another prefill chunking or other
requests in the batch change the order of the sums. These kernels fix every reduction order
so that it depends only on the token's own context, never on what it was computed beside
(the idea of vLLM's and SGLang's batch-invariant kernels, here on CPU):

* **Matrix products** are bag sums (``linear``; the kernels are described under attention):
  an output element is one fused multiply-add after another over the input features in
  order, then the bias, the same chain for a row alone, in a batch, in a packed tree or in a
  prefill chunk. BLAS products are not: MKL picks its kernel, its blocking and how it splits
  a sum by the row count, the thread count and the CPU it finds (seen: rows padded to a
  multiple of 4 were invariant on one Xeon, not on the next one nor on CI's host, for 128 or
  more input features). A bag product takes ~3-4x BLAS's time on this project's shapes.
* **Attention** sums with ``embedding_bag`` (FBGEMM's kernels): a bag sum is, per output
  element, one fused multiply-add after another over the bag's terms in their order, from 0,
  whatever other bags and lanes share the call; nothing is summed across vector lanes, so the
  AVX2 and AVX-512 kernels give the same bits too. A score is such a chain over Dh, a query's
  output and its softmax denominator are chains over its keys in position order. Keys past a
  query's position carry weight exact 0 and add nothing (``fma(0, v, acc) == acc``), so a
  query's result depends only on its keys 0..position, never on the padding, the batch, the
  chunk it came in or where its KV was computed. The softmax maximum is exact in any order
  and ``exp`` is elementwise. Operands are contiguous: a strided one sends torch to its own
  loop, which multiplies and adds with two roundings. Under autograd the gradient is plain
  softmax attention's (a gradient needs no fixed order; only the forward's bits matter).
* **SiLU** is ``x / (1 + exp(-x))``: torch's fused ``silu`` and ``sigmoid`` give another last
  bit for elements that fall in a vector loop's scalar tail (seen here: ~4% of tail elements),
  so an element's value depends on its place in the tensor. ``exp``, ``rsqrt``, products and
  sums of two numbers are the same in the tail as in the body.

RMSNorm (a mean over one row), rotary positions (computed per element in float64),
embeddings and ``log_softmax`` over a row are invariant as they are.

What it costs: products and attention sums in bag kernels (a decode
step reads K^T and V where the engine's cache holds them; they run near BLAS speed but
``exp``, the maximum and the masks are separate passes and each layer is some 30 small torch
calls where SDPA is one), SiLU in four passes; ``bench engines`` reports the tokens/s ratio
against ``native`` (docs/rl.md). What it does not cover: GPU kernels and bf16 (their gap is
measured per step, not assumed away).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 64     # copied K^T tables are this many keys wide or a multiple: bag kernels are compiled per width
QUERY_ROWS = 128   # query rows per tile: its scores stay in L2 (any value gives the same bits)
LANES = 16         # a by-keys tile's query rows are padded to a multiple of this (a vector)
KEYS_FIRST = 32    # tiles of at least this many query rows per kv head sum by keys
KEY_CHUNK = 1024   # by keys, the values bags take at most this many keys at a time (P^T ~ L2)
KEPT_ROW_INDICES = 1 << 16  # a weight keeps its products' bag index lists up to this many indices
MAX_KEPT_INDICES = 1 << 22   # a memo keeps bag index lists of at most this many indices in all
MAX_KEPT = 64                # and at most this many lists and masks


def round_up(n: int, tile: int) -> int:
    """``n`` rounded up to a whole number of ``tile`` (0 stays 0)."""
    return -(-n // tile) * tile


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output element is a bag sum over its row's input features in
    order (the module docstring), so a row's result is a function of that row alone. Under
    autograd the gradient is ``F.linear``'s (a gradient needs no fixed order)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias)
    return _bag_linear(x, weight, bias)


def _bag_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One bag per row of ``x``: the input features' indices 0..K-1 into W^T, weighted by the
    row (so the kernel's vector lanes run over the output features, never along the sum)."""
    lead, k, n = x.shape[:-1], x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, k).contiguous()
    m = rows.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    table, indices, offsets = _Kept.of(weight).bags(m)
    out = F.embedding_bag(indices, table, offsets, mode="sum", per_sample_weights=rows.view(-1))
    if bias is not None:
        out.add_(bias)
    return out.view(*lead, n)


class _Kept:
    """What a weight keeps for its products while its data is unchanged: W^T (the bags'
    table; a copy per call cost as much as the decode step's bag sums) and the bag index
    lists of up to ``KEPT_ROW_INDICES`` indices (a prefix serves any fewer rows). Kept on
    the weight tensor itself, so it lives and dies with the weights it was built from; an
    in-place update (an optimizer step, a weight push) changes ``_version``, a new tensor
    its ``data_ptr``, and either rebuilds it."""

    __slots__ = ("key", "table", "indices", "offsets")

    def __init__(self, weight: torch.Tensor):
        self.key = (weight.data_ptr(), weight._version)
        self.table = weight.detach().t().contiguous()
        self.indices = self.offsets = None

    @classmethod
    def of(cls, weight: torch.Tensor) -> "_Kept":
        kept = getattr(weight, "_invariant_kept", None)
        if kept is None or kept.key != (weight.data_ptr(), weight._version):
            kept = cls(weight)
            weight._invariant_kept = kept
        return kept

    def bags(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table, indices, offsets) of ``m`` bags, each the K rows of the table in order."""
        k, device = self.table.shape[0], self.table.device
        if self.offsets is not None and self.offsets.shape[0] >= m:
            return self.table, self.indices[:m * k], self.offsets[:m]
        rows = max(m, KEPT_ROW_INDICES // k)
        indices = torch.arange(k, device=device).repeat(rows)
        offsets = torch.arange(0, rows * k, k, device=device)
        if rows * k <= KEPT_ROW_INDICES:
            self.indices, self.offsets = indices, offsets
        return self.table, indices[:m * k], offsets[:m]


class _Linear(torch.autograd.Function):
    """The bag sums forward, ``F.linear``'s gradient backward: torch's embedding_bag backward
    is a generic scatter, and the gradient of a product needs no fixed summation order."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _bag_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        k, n = x.shape[-1], weight.shape[0]
        g = grad.reshape(-1, n)
        grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x.reshape(-1, k) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU from ``exp`` and a division, the same bits at every place of the tensor (in place
    on one fresh buffer when no gradient is wanted: the same kernels)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return x / (1.0 + torch.exp(-x))
    e = torch.neg(x)
    return torch.div(x, e.exp_().add_(1.0), out=e)


class KeyMask:
    """What the queries of one forward read, built once and shared by its layers (they all
    attend from the same positions). Per tile of query rows: the keys it reads (up to its
    last position) and which of them each row may not see (only over the keys some row of
    the tile cannot see; broadcast over the kv heads); and the index lists of the bag sums.
    Row ``t * groups + g`` is query head g of a kv group at position t. ``positions``: the
    queries' [B, T] positions it was built from."""

    def __init__(self, q_pos: torch.Tensor, groups: int, memo: dict | None = None):
        B, T = q_pos.shape
        self.positions = q_pos
        self.row_pos = q_pos[:, :, None].expand(B, T, groups).reshape(B, T * groups)
        self._tiles: dict[tuple, tuple] = {}
        self._reach: dict[int, int] = {}
        # Bag index lists depend on shapes only: a caller that attends with the same shapes
        # forward after forward (an engine) passes one dict to keep them in (``memo``).
        self._bags: dict[tuple, tuple] = {} if memo is None else memo

    @classmethod
    def causal(cls, start: int, length: int, groups: int, device, memo: dict) -> "KeyMask":
        """The mask of one sequence's tokens start..start+length-1 after ``start`` cached ones,
        kept in ``memo`` with the bag index lists: prompts of one length share it."""
        key = ("causal", start, length, groups, torch.device(device))
        mask = memo.get(key)
        if mask is None:
            mask = cls(causal_positions(1, start, length, device), groups, memo)
            _keep(memo, key, mask, 0)
        return mask

    def reach(self, keys: int) -> int:
        """Keys any query reads, of ``keys`` available."""
        if keys not in self._reach:
            self._reach[keys] = min(keys, int(self.row_pos.max()) + 1)
        return self._reach[keys]

    def tile(self, r0: int, r1: int, keys: int, by_keys: bool):
        """(keys read, first hidden key, hidden) for rows [r0, r1) of ``keys`` available. Keys
        below the first hidden one are visible to every row of the tile, so ``hidden`` (True
        where a row may not see a key; None when none is hidden) covers only the keys from
        there: by rows [B, 1, rows, keys]; by keys [keys, B, 1, rows padded to LANES], the
        bags' key-major layout."""
        key = (r0, r1, keys, by_keys)
        if key not in self._tiles:
            pos = self.row_pos[:, r0:r1]
            span = min(keys, int(pos.max()) + 1)                                  # keys any row here sees
            lo = min(span, int(pos.min()) + 1)
            key_at = torch.arange(lo, span, device=pos.device) if lo < span else None
            if key_at is None:   # every row sees every key (a decode step of equal lengths)
                hidden = None
            elif by_keys:   # padding rows repeat the last row's position (and are dropped)
                pos = torch.cat([pos, pos[:, -1:].expand(-1, round_up(r1 - r0, LANES) - (r1 - r0))], dim=1)
                hidden = (key_at[:, None, None] > pos[None])[:, :, None]
            else:
                hidden = (key_at > pos[..., None])[:, None]
            self._tiles[key] = (span, lo, hidden)
        return self._tiles[key]

    def bags(self, outer: int, inner: int, outer_stride: int, inner_stride: int, length: int,
             step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, offsets) of ``outer x inner`` bags of ``length`` table rows each: bag
        (o, i) reads rows ``o * outer_stride + i * inner_stride + step * j``, j = 0.. in order.
        Kept in the memo for the forward's other layers (and an engine's next forwards)."""
        device = self.positions.device
        key = (outer, inner, outer_stride, inner_stride, length, step, device)
        bags = self._bags.get(key)
        if bags is None:
            start = (torch.arange(outer, device=device)[:, None] * outer_stride
                     + torch.arange(inner, device=device) * inner_stride)
            indices = start[..., None] + torch.arange(length, device=device) * step
            bags = (indices.view(-1), torch.arange(outer * inner, device=device) * length)
            self._keep(key, bags, indices.numel())
        return bags

    def key_bags(self, keys: int, groups: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One bag per (key, group) of ``length`` rows, group g's rows g * length..: the same
        rows for every key, so the lists for fewer keys are prefixes of these (one list serves
        every tile)."""
        device = self.positions.device
        key = ("keys", groups, length, device)
        kept = self._bags.get(key)
        if kept is None or kept[2] < keys:
            n = max(keys, 2 * kept[2]) if kept is not None else keys
            indices = torch.arange(groups * length, device=device).repeat(n)
            kept = (indices, torch.arange(n * groups, device=device) * length, n)
            self._keep(key, kept, indices.numel())
        return kept[0][:keys * groups * length], kept[1][:keys * groups]

    def chained_bags(self, outer: int, inner: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``outer x inner`` bags that each first read their own running sum (table row
        ``o * inner + i``) and then ``length`` rows of the chunk after those sums, the rows of
        group o every ``outer`` rows from row ``outer * inner + o``."""
        device = self.positions.device
        key = ("chained", outer, inner, length, device)
        bags = self._bags.get(key)
        if bags is None:
            head = torch.arange(outer * inner, device=device).view(outer, inner, 1)
            body = (outer * inner + torch.arange(outer, device=device)[:, None, None]
                    + torch.arange(length, device=device) * outer).expand(outer, inner, length)
            indices = torch.cat([head, body], dim=2)
            bags = (indices.view(-1), torch.arange(outer * inner, device=device) * (length + 1))
            self._keep(key, bags, indices.numel())
        return bags

    def _keep(self, key: tuple, value, size: int) -> None:
        _keep(self._bags, key, value, size)


def _keep(memo: dict, key: tuple, value, size: int) -> None:
    """Keep ``value`` (``size`` indices) in ``memo``, emptying it first when full: it holds
    what shapes alone determine, so anything dropped is rebuilt on demand."""
    kept = memo.get("kept indices", 0)
    if len(memo) > MAX_KEPT or kept + size > MAX_KEPT_INDICES:
        memo.clear()
        kept = 0
    if size <= MAX_KEPT_INDICES:
        memo[key] = value
        memo["kept indices"] = kept + size


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              mask: KeyMask | None = None) -> torch.Tensor:
    """Softmax attention of each query over the keys at positions 0..its own, order-invariant.

    ``q`` [B, Hq, T, Dh]; ``k``, ``v`` [B, Hkv, S, Dh] with each row's keys at their absolute
    positions 0..S-1 (keys past a query's position may hold anything finite: they are masked);
    ``q_pos`` [B, T], the absolute position of each query. Query head h reads kv head
    h // (Hq / Hkv). Returns [B, Hq, T, Dh] in their dtype (one). ``mask``: the ``KeyMask`` of
    ``q_pos`` when several layers attend from the same positions (built here otherwise).

    Every sum is a bag sum (``embedding_bag``, see the module docstring): a score is q . k
    over Dh, an output the probabilities times V over positions 0.., its denominator the
    probabilities over the same positions, each one fused multiply-add after another in that
    order. Tiles of few query rows (decode) sum by rows (``_by_rows``), tiles of many
    (prefill, the trainer) by keys (``_by_keys``): the same multiply-adds in the same order,
    so the same bits, arranged for the kernel's vector lanes. A kv group's query heads sit
    side by side in the rows, so a tile covers few positions and skips the keys past them.
    Under autograd the gradient comes from plain softmax attention (``_Attention``).
    """
    B, Hq, T, Dh = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv:
        raise ValueError(f"invariant.attention: {Hq} query heads are not a multiple of {Hkv} kv heads")
    if q_pos.shape != (B, T):
        raise ValueError(f"invariant.attention: q_pos has shape {tuple(q_pos.shape)}, expected {(B, T)}")
    mask = mask if mask is not None else KeyMask(q_pos, Hq // Hkv)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _Attention.apply(q, k, v, mask)
    return _attend(q, k, v, mask)


class _Attention(torch.autograd.Function):
    """The bag sums forward (the engine's bits), the gradient of plain softmax attention
    backward (SDPA over one tile of queries at a time, recomputed): the same function up to
    rounding, and a gradient needs no fixed order. torch's embedding_bag backward is a
    generic scatter (sorting indices): measured 2x the trainer's whole step. Saves q, k and
    v only, so memory stays linear in the row."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        ctx.save_for_backward(q, k, v, mask.positions)
        return _attend(q, k, v, mask)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, q_pos = ctx.saved_tensors
        G, S = q.shape[1] // k.shape[1], k.shape[2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        key_at = torch.arange(S, device=q.device)
        for t0 in range(0, q.shape[2], QUERY_ROWS):
            t1 = min(q.shape[2], t0 + QUERY_ROWS)
            with torch.enable_grad():
                qt, kk, vv = (t.detach().requires_grad_() for t in (q[:, :, t0:t1], k, v))
                seen = (key_at <= q_pos[:, t0:t1, None])[:, None]
                out = F.scaled_dot_product_attention(qt, kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1),
                                                     attn_mask=seen)
                gq, gk, gv = torch.autograd.grad(out, (qt, kk, vv), grad[:, :, t0:t1])
            dq[:, :, t0:t1] = gq
            dk += gk
            dv += gv
        return dq, dk, dv, None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: KeyMask) -> torch.Tensor:
    B, Hq, T, Dh = q.shape
    Hkv = k.shape[1]
    G, BH = Hq // Hkv, B * Hkv
    rows = q * (1.0 / (Dh ** 0.5))
    rows = rows.reshape(BH, G, Dh) if T == 1 else rows.view(B, Hkv, G, T, Dh).transpose(2, 3).reshape(BH, T * G, Dh)
    if T == 1 and G < KEYS_FIRST:   # a decode step: one tile, by rows, already in head order
        span, lo, hidden = mask.tile(0, G, k.shape[2], False)
        return _by_rows(rows, k, v, span, lo, hidden, mask).view(B, Hq, 1, Dh)
    outs, kv = [], None
    for r0 in range(0, T * G, QUERY_ROWS):
        r1 = min(T * G, r0 + QUERY_ROWS)
        by_keys = r1 - r0 >= KEYS_FIRST
        span, lo, hidden = mask.tile(r0, r1, k.shape[2], by_keys)
        if by_keys:
            kv = kv if kv is not None else _key_major(k, v, mask.reach(k.shape[2]))
            outs.append(_by_keys(rows[:, r0:r1], kv, span, lo, hidden, mask))
        else:
            outs.append(_by_rows(rows[:, r0:r1], k, v, span, lo, hidden, mask).transpose(1, 2))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)                 # [BH, Dh, rows]
    return out.view(B, Hkv, Dh, T, G).permute(0, 1, 4, 3, 2).reshape(B, Hq, T, Dh)


def _by_rows(rows, k, v, span, lo, hidden, mask) -> torch.Tensor:
    """One bag per query row: its scores sum the Dh rows of K^T (lanes: keys) weighted by
    its q, its output the rows of V (lanes: Dh) weighted by its probabilities; the
    denominators sum the rows of P^T (lanes: the query rows), all weighted by 1. ``k`` laid
    out as K^T (the engine's cache) is read where it lies when the tile reads most of it;
    otherwise the tile copies the K^T it reads. [BH, n, Dh]."""
    B, Hkv, S, Dh = k.shape
    BH, n = B * Hkv, rows.shape[1]
    keys_t = k.transpose(-1, -2)                                                   # [B, Hkv, Dh, S]
    if keys_t.is_contiguous() and 2 * span > S:
        table = keys_t.view(BH * Dh, S)
    else:
        width = min(S, round_up(span, KEY_BLOCK))
        table = keys_t[..., :width].contiguous().view(BH * Dh, width)
    idx, off = mask.bags(BH, n, Dh, 0, Dh)
    scores = F.embedding_bag(idx, table, off, mode="sum", per_sample_weights=rows.contiguous().view(-1))
    p = _numerators(scores[:, :span].view(B, Hkv, n, span), lo, hidden, keys_dim=-1).view(-1)
    idx, off = mask.bags(BH, n, S, 0, span)
    acc = F.embedding_bag(idx, v.contiguous().view(BH * S, Dh), off, mode="sum", per_sample_weights=p)
    idx, off = mask.bags(1, 1, 0, 0, span)
    denom = F.embedding_bag(idx, p.view(BH * n, span).t().contiguous(), off, mode="sum",
                            per_sample_weights=p.new_ones(span))
    return (acc / denom.view(BH * n, 1)).view(BH, n, Dh)


def _key_major(k: torch.Tensor, v: torch.Tensor, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``reach`` keys as rows, key-major ([keys, BH, Dh]: a tile's keys are a
    prefix), and V^T with a row of 1s ([BH, Dh + 1, keys]): the by-keys bags' weights."""
    B, Hkv, S, Dh = k.shape
    keys = k[:, :, :reach].permute(2, 0, 1, 3).contiguous().view(reach, B * Hkv, Dh)
    columns = torch.cat([v[:, :, :reach].transpose(-1, -2), v.new_ones(B, Hkv, 1, reach)], dim=2)
    return keys, columns.view(B * Hkv, Dh + 1, reach)


def _by_keys(rows, kv, span, lo, hidden, mask) -> torch.Tensor:
    """One bag per (key, kv head) for the scores: its K row weights the Dh rows of Q^T (lanes:
    the query rows); then one bag per (kv head, output column): a column of V, or 1s for the
    denominator, weights the rows of P^T (lanes again the query rows). Rows are padded to
    ``LANES``. Each values bag streams all of P^T, so more than ``KEY_CHUNK`` keys go chunk
    by chunk (P^T stays in L2): a bag's sum so far enters the next chunk's bag as its first
    term, weight 1, and ``fma(1, s, 0) == s``, so the chain of multiply-adds is unbroken and
    the bits are those of one bag over all keys. [BH, Dh, n]."""
    keys, columns = kv
    BH, n, Dh = rows.shape
    B, lanes = mask.positions.shape[0], round_up(n, LANES)
    q_t = (rows if lanes == n else F.pad(rows, (0, 0, 0, lanes - n))).transpose(1, 2).contiguous().view(BH * Dh, lanes)
    idx, off = mask.key_bags(span, BH, Dh)
    scores = F.embedding_bag(idx, q_t, off, mode="sum", per_sample_weights=keys[:span].view(-1))
    scores = scores.view(span, B, BH // B, lanes)
    top = _mask_top(scores, lo, hidden, keys_dim=0)
    if span <= KEY_CHUNK:
        p_t = _exp_from(scores, top, lo, hidden, keys_dim=0)
        idx, off = mask.bags(BH, Dh + 1, 1, 0, span, BH)
        out = F.embedding_bag(idx, p_t.view(span * BH, lanes), off, mode="sum",
                              per_sample_weights=columns[..., :span].contiguous().view(-1))
    else:
        out = scores.new_zeros(BH * (Dh + 1), lanes)
        for c0 in range(0, span, KEY_CHUNK):
            c1 = min(span, c0 + KEY_CHUNK)
            at = min(max(lo, c0), c1)                     # the chunk's first hidden key
            p_t = _exp_from(scores[c0:c1], top, at - c0, None if at == c1 else hidden[at - lo:c1 - lo], keys_dim=0)
            idx, off = mask.chained_bags(BH, Dh + 1, c1 - c0)
            weights = torch.cat([columns.new_ones(BH, Dh + 1, 1), columns[..., c0:c1]], dim=2)
            out = F.embedding_bag(idx, torch.cat([out, p_t.view(-1, lanes)]), off, mode="sum",
                                  per_sample_weights=weights.view(-1))
    out = out.view(BH, Dh + 1, lanes)
    return out[:, :Dh, :n] / out[:, Dh:, :n]


def _numerators(scores: torch.Tensor, lo: int, hidden: torch.Tensor, keys_dim: int) -> torch.Tensor:
    """exp(score - max over ``keys_dim``) for the keys a row may see, exact 0 for the others,
    in a contiguous tensor, in place where ``scores`` (a view of a buffer nobody else holds)
    allows. ``hidden`` covers the keys from ``lo`` on."""
    return _exp_from(scores, _mask_top(scores, lo, hidden, keys_dim), lo, hidden, keys_dim)


def _mask_top(scores: torch.Tensor, lo: int, hidden: torch.Tensor, keys_dim: int) -> torch.Tensor:
    """The maximum over ``keys_dim`` of the keys a row may see (exact in any order); hidden
    keys are set to -1e30 in place for it (not -inf: see ``_exp_from``)."""
    if lo < scores.shape[keys_dim]:
        scores.narrow(keys_dim, lo, scores.shape[keys_dim] - lo).masked_fill_(hidden, -1e30)
    return scores.amax(dim=keys_dim, keepdim=True)


def _exp_from(scores: torch.Tensor, top: torch.Tensor, lo: int, hidden: torch.Tensor, keys_dim: int) -> torch.Tensor:
    """exp(score - top), exact 0 for hidden keys (those from ``lo`` on where ``hidden``).

    The exponent is clamped to [-80, 0]: torch's exp takes a slow path (measured here
    10-35x) below about -87, where its results underflow; a visible term below e^-80 of the
    largest counts as e^-80, which no float32 sum of terms including 1 (the largest) can
    tell apart from 0. Hidden keys (-1e30) land there too and are then set to 0."""
    s = torch.sub(scores, top, out=scores if scores.is_contiguous() else None).contiguous()
    s.clamp_(-80.0, 0.0).exp_()
    if lo < s.shape[keys_dim]:
        s.narrow(keys_dim, lo, s.shape[keys_dim] - lo).masked_fill_(hidden, 0.0)
    return s


def causal_positions(batch: int, start: int, length: int, device) -> torch.Tensor:
    """[B, T] positions start..start+T-1: a plain sequence after ``start`` cached tokens."""
    return torch.arange(start, start + length, device=device)[None].expand(batch, length)

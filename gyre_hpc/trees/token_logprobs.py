"""log p(target | row) through the output head a few rows at a time: no [N, V] logits held.

Why: with a real vocabulary the logits are the largest tensor of a training step. A 32K-token
path through a 49,152-token head is a [32K, 49K] float32 tensor of 6.4 GB, and autograd keeps
as much again for ``log_softmax``'s output and builds a third for its gradient, where the
model's own activations at 576 wide are a few hundred MB. Here the head's product,
``log_softmax`` and the gather of the target run over ``chunk_tokens`` rows at a time, and
the backward recomputes each chunk's logits instead of keeping them (a custom autograd
Function: it saves only the hidden rows, the weight and the targets), so what the head holds
at once is one chunk's [chunk, V].

Why the bits do not move: every row's logprob depends on that row alone. Under invariant
numerics the product is ``models.invariant.linear`` (a bag sum per row, the same chain of
multiply-adds for a row alone or among any others) and ``log_softmax`` reduces within a row,
so a token's logprob is the same number in a chunk of 1, of 1024, or unchunked, as the
engine computes it (design section 8). The backward needs no fixed order (only the
forward's bits are compared with the engine's) and uses plain BLAS products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gyre_hpc.models import invariant as inv

# 1024 rows of a 49K head are 200 MB of float32 logits: large enough for BLAS to run at speed,
# small beside the model's own activations at that width.
LOGIT_CHUNK_TOKENS = 1024


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int = LOGIT_CHUNK_TOKENS, invariant: bool = False) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T)[i, targets[i]]`` for each row i, ``chunk_tokens`` rows
    at a time forward and backward (module doc). ``hidden`` [N, D], ``weight`` [V, D] (the
    output head, or the tied embedding), ``targets`` [N] token ids; returns [N] in
    ``hidden``'s dtype. ``invariant``: the head's product through ``models.invariant``."""
    if chunk_tokens < 1:
        raise ValueError(f"head_logprobs: chunk_tokens={chunk_tokens} must be >= 1")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"head_logprobs: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         "must be [N, D] and [V, D]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"head_logprobs: targets {tuple(targets.shape)} must be [N] for hidden "
                         f"{tuple(hidden.shape)}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _HeadLogprobs.apply(hidden, weight, targets, chunk_tokens, invariant)
    return _forward(hidden, weight, targets, chunk_tokens, invariant)


def _forward(hidden, weight, targets, chunk_tokens: int, invariant: bool) -> torch.Tensor:
    out = hidden.new_empty(hidden.shape[0])
    for s in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[s:s + chunk_tokens]
        logits = inv.linear(h, weight) if invariant else h @ weight.T
        out[s:s + chunk_tokens] = F.log_softmax(logits, dim=-1).gather(-1, targets[s:s + chunk_tokens, None])[:, 0]
    return out


class _HeadLogprobs(torch.autograd.Function):
    """Forward chunk by chunk without a graph; backward recomputes each chunk's logits.

    d logp_i / d logits_i = onehot(target_i) - softmax(logits_i), so a chunk's logits
    gradient is ``g_i * (onehot - p)``, built in place in the recomputed logits' buffer; it
    gives the hidden rows' gradient (``dlogits @ W``) and adds ``dlogits^T @ h`` into the
    weight's (accumulated in float32 when the model is in a lower precision)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, invariant):
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_tokens = chunk_tokens
        return _forward(hidden, weight, targets, chunk_tokens, invariant)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                         device=weight.device) if need_w else None
        for s in range(0, hidden.shape[0], ctx.chunk_tokens):
            h, g, t = hidden[s:s + ctx.chunk_tokens], grad[s:s + ctx.chunk_tokens], targets[s:s + ctx.chunk_tokens]
            dlogits = h @ weight.T
            dlogits.sub_(torch.logsumexp(dlogits, dim=-1, keepdim=True)).exp_().mul_(-g[:, None])
            dlogits[torch.arange(t.shape[0], device=t.device), t] += g
            if need_h:
                dh[s:s + ctx.chunk_tokens] = dlogits @ weight
            if need_w:
                dw.addmm_(dlogits.t().to(dw.dtype), h.to(dw.dtype))
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None

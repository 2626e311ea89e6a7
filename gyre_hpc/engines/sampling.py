"""Picking one token from one row of logits: greedy, or seeded nucleus sampling.

Why inverse-CDF with one uniform draw per token: the request's generator then advances by
exactly one draw per token whatever the vocabulary, the batch or the engine, so its state
is a small, portable thing to migrate, and the same seed gives the same tokens on any
engine that computes the same logits. The CDF is built in float64 so the choice does not
hinge on float32 rounding of a long cumulative sum.
"""
from __future__ import annotations

import torch

from gyre_hpc.engines.requests import SamplingParams


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 probabilities of softmax(logits / T) restricted to the top-p nucleus (sum 1)."""
    probs = torch.softmax(logits.to(torch.float64) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        # Keep a token while the mass above it is short of top_p; the first is always kept.
        keep_sorted = before < params.top_p
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """(token id, its logprob under the untempered model) for a [V] row of logits."""
    if logits.dim() != 1:
        raise ValueError(f"sample_token expects one [V] row of logits, got shape {tuple(logits.shape)}")
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
        if generator is None:
            raise ValueError("sample_token: temperature > 0 needs the request's generator")
        cdf = torch.cumsum(sampling_probs(logits, params), dim=-1)
        u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
        token = int(torch.searchsorted(cdf, u, right=True).clamp(max=logits.shape[-1] - 1))
    return token, float(logprobs[token])

"""Shared by the engine tests, the MPI programs they launch, and nothing else.

Why a "sharp" model: the tiny preset at its default init has nearly flat logits, so greedy
decoding repeats one token whatever the context, and a broken KV cache would still "match".
Scaling every weight matrix by 10 gives peaked, context-dependent predictions, so a wrong
cache, position or sampler state shows up as different tokens.
"""
from __future__ import annotations

import torch

from gyre_hpc.models.tiny_lm import BOS_ID, TinyLM, build_model

SHARPNESS = 10.0


def make_sharp_model(seed: int = 1) -> TinyLM:
    model = build_model("tiny", seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(SHARPNESS)
    return model


def prompt(i: int, length: int = 12) -> tuple[int, ...]:
    """Distinct prompts of varied length: BOS then bytes of a line of code."""
    text = f"def f{i}(x):\n    return x * {i} + {i * 7}\n" * 4
    return (BOS_ID,) + tuple(text.encode()[: length + 3 * i])

"""Model FLOP utilisation of a training step: its FLOP rate over this machine's own GEMM rate.

Why against a GEMM measured in the same run and not a datasheet peak: the benchmarks run on
shared CPUs whose rate moves with the load; a training kernel that regresses shows as a lower
ratio, while a busier machine slows both sides. The GEMMs are the model's own shapes (every
projection of one layer, weighted by the layer count, and the output head), so the reference
is what BLAS reaches on exactly this model, at one thread as the step runs.

The FLOPs counted are the model's (forward, and backward as twice the forward), recomputation
not counted (the chunked output head recomputes its logits in the backward; that is cost the
ratio should show, not work it should credit):

- every projection of every layer, 2 x in x out per packed token;
- attention, 4 x head_dim per head per visible (query, key) pair: a token at position p of
  its path sees p + 1 keys (its path's prefix; tree or document masking alike);
- the output head, 2 x d_model x vocab per trained token (only positions that predict a
  trained token go through it, ``trees.loss``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from gyre_hpc.models.decoder import LMConfig


def layer_shapes(cfg: LMConfig) -> list[tuple[int, int]]:
    """(in, out) of every projection of one decoder layer."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [(cfg.d_model, q), (cfg.d_model, kv), (cfg.d_model, kv), (q, cfg.d_model),
            (cfg.d_model, cfg.d_ff), (cfg.d_model, cfg.d_ff), (cfg.d_ff, cfg.d_model)]


@dataclass(frozen=True)
class StepFlops:
    projections: int
    attention: int
    head: int

    @property
    def total(self) -> int:
        return self.projections + self.attention + self.head


def step_flops(cfg: LMConfig, packed_tokens: int, attention_pairs: int, head_tokens: int) -> StepFlops:
    """Forward + backward (3 x forward) FLOPs of a step over ``packed_tokens`` tokens, of which
    ``head_tokens`` go through the output head, with ``attention_pairs`` visible pairs."""
    per_token = 2 * sum(i * o for i, o in layer_shapes(cfg)) * cfg.n_layers
    return StepFlops(projections=3 * per_token * packed_tokens,
                     attention=3 * 4 * cfg.head_dim * cfg.n_heads * cfg.n_layers * attention_pairs,
                     head=3 * 2 * cfg.d_model * cfg.vocab_size * head_tokens)


def attention_pairs(position_ids: np.ndarray) -> int:
    """Visible (query, key) pairs of packed tokens at these path positions: p + 1 each."""
    return int((np.asarray(position_ids, dtype=np.int64) + 1).sum())


def gemm_rate(cfg: LMConfig, tokens: int = 512, repeats: int = 3) -> dict:
    """FLOP/s of ``torch.matmul`` at the model's shapes, [tokens, in] @ [in, out] float32, at the
    caller's thread count: each shape timed best of ``repeats`` after a warm-up, combined in the
    model's mix (n_layers x one layer's projections, plus the head once)."""
    import torch

    def best_s(n_in: int, n_out: int) -> float:
        x, w = torch.randn(tokens, n_in), torch.randn(n_in, n_out)
        torch.matmul(x, w)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.matmul(x, w)
            times.append(time.perf_counter() - t0)
        return min(times)

    layer = layer_shapes(cfg)
    seconds = cfg.n_layers * sum(best_s(i, o) for i, o in layer) + best_s(cfg.d_model, cfg.vocab_size)
    flops = 2 * tokens * (cfg.n_layers * sum(i * o for i, o in layer) + cfg.d_model * cfg.vocab_size)
    return {"flop_s": flops / seconds, "tokens": tokens, "repeats": repeats, "threads": torch.get_num_threads()}

"""Supervised fine-tuning on trajectory trees: cross-entropy on every trained token, tree-packed.

The rows are the RL trainer's rows (``trees.packing.pack``, tree attention, each token at
its position along its own path), so a context shared by many calls is computed once here
too, and the loss is the RL loss's log-probabilities (``trees.loss.packed_head_logprobs``:
the output head in chunks of tokens) averaged over the row's trained tokens.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gyre_hpc.trees.attention import tree_attention
from gyre_hpc.trees.loss import packed_head_logprobs
from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.packing import collate, pack


@dataclass(frozen=True)
class SFTReport:
    steps: int
    seconds: float
    loss_first: float
    loss_last: float       # mean over the last epoch's worth of rows
    rows: int
    tokens: int
    stopped_by: str        # "steps" or "time"


def row_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    attention_fn = tree_attention("sdpa", batch.subtree_end, needs_grad=torch.is_grad_enabled())
    hidden = model(batch.input_ids, batch.position_ids, attention_fn=attention_fn, head=False)
    logp, _ = packed_head_logprobs(hidden, model.output_weight, batch)
    return -logp.mean()


def train_sft(model: torch.nn.Module, trees: Sequence[Tree], steps: int, lr: float, row_tokens: int,
              max_s: float, seed: int = 0, log=None) -> SFTReport:
    """AdamW over packed rows in shuffled epochs, until ``steps`` or ``max_s`` seconds."""
    rows = [r for r in pack(list(trees), row_tokens) if r.n_loss_tokens > 0]
    if not rows:
        raise ValueError("train_sft: the trees hold no trained token")
    batches = [collate([r]) for r in rows]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.99),
                            weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 10) * max(0.1, 1 - k / steps))
    rng = np.random.default_rng(seed)
    model.train()
    t0 = time.perf_counter()
    recent: deque[float] = deque(maxlen=len(batches))     # one epoch's worth of row losses
    first = None
    step, stopped = 0, "steps"
    order: list[int] = []
    while step < steps:
        if not order:
            if step and log:
                log(f"[warmstart] step {step}/{steps} epoch loss {np.mean(recent):.4f} "
                    f"{time.perf_counter() - t0:.0f}s")
            order = list(rng.permutation(len(batches)))
        loss = row_loss(model, batches[order.pop()])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = float(loss.detach())
        first = value if first is None else first
        recent.append(value)
        step += 1
        if time.perf_counter() - t0 > max_s:
            stopped = "time"
            break
    model.eval()
    return SFTReport(step, time.perf_counter() - t0, float(first), float(np.mean(recent)), len(rows),
                     int(sum(r.n_tokens for r in rows)), stopped)

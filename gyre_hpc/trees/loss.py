"""The tree-masked policy-gradient loss, exact under any split into micro-batches and replicas.

Per trained token: a PPO-style clipped surrogate with importance ratio
``exp(logp - behaviour_logp)`` and the run's advantage (its reward normalised within the
runs of the same task). Tokens are averaged within their run, then runs are averaged.

Why the weights come from outside: a micro-batch sees only part of a run's tokens and
part of the step's runs, so it cannot know the denominators. :class:`StepWeights` is
computed once for the whole step, every token's weight is ``1 / (tokens of its run x
runs in the step)``, and the step loss is a plain *sum* over tokens. Summing micro-batch
losses, and summing replica gradients (allreduce SUM, not mean), therefore gives exactly
the full-batch loss and gradient, however the rows are dealt out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.packing import PackedBatch


def group_advantages(rewards: Sequence[float], task_ids: Sequence[str]) -> np.ndarray:
    """(reward - group mean) / group std over the runs of each task; 0 where the std is 0.

    The population std (ddof=0) is used so a group of two distinct rewards gives +-1. A
    group whose runs all scored the same carries no signal about which behaviour was better,
    so its advantages are 0 rather than a division by zero.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.shape != (len(task_ids),):
        raise ValueError(f"group_advantages: {rewards.size} rewards for {len(task_ids)} task ids")
    adv = np.zeros_like(rewards)
    tasks = np.asarray(task_ids, dtype=object)
    for task in dict.fromkeys(task_ids):
        idx = np.flatnonzero(tasks == task)
        std = rewards[idx].std()
        if std > 1e-12 * max(1.0, np.abs(rewards[idx]).max()):
            adv[idx] = (rewards[idx] - rewards[idx].mean()) / std
    return adv


@dataclass(frozen=True)
class StepWeights:
    """Per-run figures of a whole training step, fixed before any micro-batch runs."""

    advantages: np.ndarray   # float64 [R]
    run_tokens: np.ndarray   # int64 [R], trained tokens of each run in the step
    n_runs: int              # runs with at least one trained token

    @classmethod
    def from_trees(cls, trees: Sequence[Tree]) -> "StepWeights":
        return cls.from_counts([t.reward for t in trees], [t.task_id for t in trees],
                               [int(t.trained.sum()) for t in trees])

    @classmethod
    def from_counts(cls, rewards: Sequence[float], task_ids: Sequence[str], run_tokens: Sequence[int]) -> "StepWeights":
        run_tokens = np.asarray(run_tokens, dtype=np.int64)
        # A run with nothing to train (every output empty or pruned) has no average to take:
        # it is left out of the run count rather than diluting the others.
        return cls(group_advantages(rewards, task_ids), run_tokens, int((run_tokens > 0).sum()))

    @property
    def run_weight(self) -> np.ndarray:
        """Weight of one token of each run: 1 / (its run's tokens x runs in the step)."""
        w = np.zeros(self.run_tokens.size, dtype=np.float64)
        has = self.run_tokens > 0
        w[has] = 1.0 / (self.run_tokens[has] * self.n_runs)
        return w


def clipped_pg_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantage: torch.Tensor,
                    weight: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Sum over tokens of weight x -min(r A, clip(r, 1-eps, 1+eps) A), r = exp(logp - behaviour)."""
    ratio = torch.exp(logp - behaviour_logp)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantage)
    return -(weight * surrogate).sum()


def packed_token_logprobs(logits: torch.Tensor, batch: PackedBatch):
    """log p(token | its own path) for every loss token of the batch, and where they sit.

    Only the loss tokens' predecessor rows of the logits go through log_softmax, so the
    [N, V] work is proportional to trained tokens, not to the row length.
    """
    b, j = batch.loss_mask.nonzero(as_tuple=True)
    pred = batch.pred_index[b, j]
    if bool((pred < 0).any()):
        raise ValueError("packed batch has a trained token with no predecessor on its path")
    logp = F.log_softmax(logits[b, pred], dim=-1)
    return logp.gather(-1, batch.input_ids[b, j][:, None])[:, 0], (b, j)


def tree_loss(logits: torch.Tensor, batch: PackedBatch, weights: StepWeights, clip_eps: float) -> torch.Tensor:
    """This micro-batch's share of the step loss (sum it over micro-batches; see module doc)."""
    logp, (b, j) = packed_token_logprobs(logits, batch)
    run = batch.run_index[b, j]
    as_t = lambda a: torch.as_tensor(a, dtype=logits.dtype, device=logits.device)  # noqa: E731
    return clipped_pg_loss(
        logp,
        batch.behaviour_logprobs[b, j].to(logits.dtype),
        as_t(weights.advantages)[run],
        as_t(weights.run_weight)[run],
        clip_eps,
    )


def packed_loss(model: torch.nn.Module, batch: PackedBatch, weights: StepWeights, clip_eps: float,
                attention: str = "auto") -> torch.Tensor:
    """Forward one packed micro-batch with tree attention and return its share of the loss."""
    from gyre_hpc.trees.attention import tree_attention

    attention_fn = tree_attention(attention, batch.subtree_end, needs_grad=torch.is_grad_enabled())
    logits = model(batch.input_ids, batch.position_ids, attention_fn=attention_fn)
    return tree_loss(logits, batch, weights, clip_eps)

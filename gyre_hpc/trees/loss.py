"""The tree-masked policy-gradient loss, exact under any split into micro-batches and replicas.

Per trained token: a PPO-style clipped surrogate with importance ratio
``exp(logp - behaviour_logp)`` and the run's advantage (its reward normalised within the
runs of the same task). Tokens are averaged within their run, then runs are averaged.

What a "token" is here: a *target* of the ``train.shared_targets`` rule. Under ``per_sample``
a position that k calls sampled is k targets (each with its own behaviour logprob), under
``once`` it is one. The averaging rule (``train.averaging``): ``run`` (default; the paper's
rule: a run's weight does not grow with its number of paths or tokens) divides by the run's
targets x runs in the step; ``global`` divides every target by all targets of the step (the
token mean AReaL-style trainers use, for comparison with peers).

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
from gyre_hpc.trees.token_logprobs import LOGIT_CHUNK_TOKENS, head_logprobs


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
    run_tokens: np.ndarray   # int64 [R], targets of each run in the step
    n_runs: int              # runs with at least one target
    averaging: str = "run"   # AVERAGING
    # global averaging's denominator; None: the targets of these runs. The streaming trainer
    # passes 1 and divides by the step's total once, after the allreduce.
    total_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.averaging not in AVERAGING:
            raise ValueError(f"StepWeights averaging={self.averaging!r}: valid rules are {', '.join(AVERAGING)}")

    @classmethod
    def from_trees(cls, trees: Sequence[Tree], shared_targets: str = "per_sample",
                   averaging: str = "run") -> "StepWeights":
        return cls.from_counts([t.reward for t in trees], [t.task_id for t in trees],
                               [run_targets(t, shared_targets) for t in trees], averaging)

    @classmethod
    def from_counts(cls, rewards: Sequence[float], task_ids: Sequence[str], run_tokens: Sequence[int],
                    averaging: str = "run") -> "StepWeights":
        run_tokens = np.asarray(run_tokens, dtype=np.int64)
        # A run with nothing to train (every output empty or pruned) has no average to take:
        # it is left out of the run count rather than diluting the others.
        return cls(group_advantages(rewards, task_ids), run_tokens, int((run_tokens > 0).sum()), averaging)

    @property
    def run_weight(self) -> np.ndarray:
        """Weight of one target of each run: 1 / (its run's targets x runs in the step) under
        ``run`` averaging, 1 / (targets in the step) under ``global``."""
        w = np.zeros(self.run_tokens.size, dtype=np.float64)
        has = self.run_tokens > 0
        if self.averaging == "global":
            w[has] = 1.0 / (self.total_tokens if self.total_tokens is not None else int(self.run_tokens.sum()))
        else:
            w[has] = 1.0 / (self.run_tokens[has] * self.n_runs)
        return w


AVERAGING = ("run", "global")


def run_targets(tree: Tree, shared_targets: str) -> int:
    """Targets of one run's tree under the rule: its token count for averaging."""
    if tree.n_runs != 1:
        raise ValueError(f"run_targets: tree {tree.run_id!r} is a group forest of {tree.n_runs} runs; "
                         "count targets on the runs' own trees")
    return int(tree.n_targets(shared_targets)[0])


def step_denominator(run_tokens: Sequence[int], averaging: str) -> int:
    """What the summed gradient of micro-batches weighted with ``n_runs=1`` (run averaging) or
    ``total_tokens=1`` (global) is divided by: runs with a target, or the step's targets."""
    if averaging not in AVERAGING:
        raise ValueError(f"averaging={averaging!r}: valid rules are {', '.join(AVERAGING)}")
    counts = [int(n) for n in run_tokens]
    return sum(counts) if averaging == "global" else sum(1 for n in counts if n > 0)


def clipped_pg_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantage: torch.Tensor,
                    weight: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Sum over tokens of weight x -min(r A, clip(r, 1-eps, 1+eps) A), r = exp(logp - behaviour)."""
    ratio = torch.exp(logp - behaviour_logp)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantage)
    return -(weight * surrogate).sum()


def loss_rows(batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, position, predecessor position) of every loss token of the batch: the
    predecessor's output row scores the token."""
    b, j = batch.loss_mask.nonzero(as_tuple=True)
    pred = batch.pred_index[b, j]
    if bool((pred < 0).any()):
        raise ValueError("packed batch has a trained token with no predecessor on its path")
    return b, j, pred


def packed_token_logprobs(logits: torch.Tensor, batch: PackedBatch):
    """log p(token | its own path) for every loss token of the batch, and where they sit.

    Only the loss tokens' predecessor rows of the logits go through log_softmax, so the
    [N, V] work is proportional to trained positions, not to the row length (nor to how
    many samples a position carries).
    """
    b, j, pred = loss_rows(batch)
    logp = F.log_softmax(logits[b, pred], dim=-1)
    return logp.gather(-1, batch.input_ids[b, j][:, None])[:, 0], (b, j)


def packed_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, batch: PackedBatch,
                         chunk_tokens: int = LOGIT_CHUNK_TOKENS, invariant: bool = False):
    """``packed_token_logprobs`` from the final hidden states [B, T, D] and the output head's
    weight, the head applied ``chunk_tokens`` loss tokens at a time (``trees.token_logprobs``):
    the same values (the same bits under invariant numerics) without the [N, V] logits."""
    b, j, pred = loss_rows(batch)
    return head_logprobs(hidden[b, pred], weight, batch.input_ids[b, j], chunk_tokens, invariant), (b, j)


def per_sample(logp: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor], batch: PackedBatch) -> torch.Tensor:
    """The loss tokens' logprobs (``logp`` at positions ``where``) for each target (sample) of
    the batch: samples of one position share its logprob."""
    b, j = where
    slot = torch.full(batch.loss_mask.shape, -1, dtype=torch.long, device=logp.device)
    slot[b, j] = torch.arange(b.numel(), device=logp.device)
    return logp[slot[batch.sample_row, batch.sample_index]]


def sample_logprobs(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """log p of each target (sample) of the batch: its position's log-prob, shared by samples."""
    return per_sample(*packed_token_logprobs(logits, batch), batch)


@dataclass
class LogprobGap:
    """Trainer against behaviour logprobs over a step's targets, before its update.

    The train-inference mismatch: the loss divides by the engine's behaviour probability, so
    any difference between the engine's logprob and the trainer's for the same token under
    the same weights is a ratio != 1 that no policy change caused. ``max_abs``/``mean_abs``:
    |trainer - behaviour|; ``clipped``: targets whose ratio already lies outside
    [1 - eps, 1 + eps]; ``kl``: the k3 estimate of KL(behaviour || trainer), mean of
    r - 1 - log r. All 0 when the engine and trainer agree bit for bit (``model.numerics:
    invariant`` with TorchEngine), all NaN over no targets. Summed over micro-batches and
    replicas with ``merge``.
    """

    targets: int = 0
    max_abs: float = float("nan")
    sum_abs: float = 0.0
    clipped: int = 0
    kl_sum: float = 0.0

    def add(self, logp: torch.Tensor, behaviour_logp: torch.Tensor, clip_eps: float) -> None:
        if logp.numel() == 0:
            return
        d = logp.detach().to(torch.float64) - behaviour_logp.detach().to(torch.float64)
        ratio = torch.exp(d)
        worst = float(d.abs().max())
        self.max_abs = max(self.max_abs, worst) if self.targets else worst
        self.targets += int(d.numel())
        self.sum_abs += float(d.abs().sum())
        self.clipped += int(((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).sum())
        self.kl_sum += float((ratio - 1.0 - d).sum())

    def merge(self, other: "LogprobGap") -> "LogprobGap":
        worst = (other.max_abs if not self.targets else self.max_abs if not other.targets
                 else max(self.max_abs, other.max_abs))
        return LogprobGap(self.targets + other.targets, worst,
                          self.sum_abs + other.sum_abs, self.clipped + other.clipped, self.kl_sum + other.kl_sum)

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.targets if self.targets else float("nan")

    @property
    def clip_share(self) -> float:
        return self.clipped / self.targets if self.targets else float("nan")

    @property
    def kl(self) -> float:
        return self.kl_sum / self.targets if self.targets else float("nan")


def tree_loss(logits: torch.Tensor, batch: PackedBatch, weights: StepWeights, clip_eps: float,
              gap: LogprobGap | None = None) -> torch.Tensor:
    """This micro-batch's share of the step loss (sum it over micro-batches; see module doc);
    ``gap`` collects the trainer-vs-behaviour logprob figures of its targets."""
    return targets_loss(sample_logprobs(logits, batch), batch, weights, clip_eps, gap)


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, batch: PackedBatch, weights: StepWeights,
              clip_eps: float, gap: LogprobGap | None = None, chunk_tokens: int = LOGIT_CHUNK_TOKENS,
              invariant: bool = False) -> torch.Tensor:
    """``tree_loss`` from the final hidden states and the output head's weight, the head
    applied ``chunk_tokens`` loss tokens at a time: no [N, V] logits, forward or backward."""
    logp = per_sample(*packed_head_logprobs(hidden, weight, batch, chunk_tokens, invariant), batch)
    return targets_loss(logp, batch, weights, clip_eps, gap)


def targets_loss(logp: torch.Tensor, batch: PackedBatch, weights: StepWeights, clip_eps: float,
                 gap: LogprobGap | None = None) -> torch.Tensor:
    """The loss of the batch's targets given their logprobs ``logp`` [S] (``sample_logprobs``)."""
    run = batch.sample_run
    as_t = lambda a: torch.as_tensor(a, dtype=logp.dtype, device=logp.device)  # noqa: E731
    if gap is not None:
        gap.add(logp, batch.sample_logprobs, clip_eps)
    return clipped_pg_loss(
        logp,
        batch.sample_logprobs.to(logp.dtype),
        as_t(weights.advantages)[run],
        as_t(weights.run_weight)[run],
        clip_eps,
    )


def packed_loss(model: torch.nn.Module, batch: PackedBatch, weights: StepWeights, clip_eps: float,
                attention: str = "auto", gap: LogprobGap | None = None,
                logit_chunk_tokens: int = LOGIT_CHUNK_TOKENS, checkpoint_layers: bool = False) -> torch.Tensor:
    """Forward one packed micro-batch with tree attention and return its share of the loss;
    the output head runs ``logit_chunk_tokens`` loss tokens at a time (``head_loss``);
    ``checkpoint_layers``: each layer recomputed in the backward (``CausalLM.forward``)."""
    from gyre_hpc.trees.attention import tree_attention

    attention_fn = tree_attention(attention, batch.subtree_end, needs_grad=torch.is_grad_enabled(),
                                  position_ids=batch.position_ids)
    invariant = invariant_kwargs(attention_fn)
    hidden = model(batch.input_ids, batch.position_ids, attention_fn=attention_fn, head=False,
                   checkpoint_layers=checkpoint_layers, **invariant)
    return head_loss(hidden, model.output_weight, batch, weights, clip_eps, gap, logit_chunk_tokens, bool(invariant))


def invariant_kwargs(attention_fn) -> dict:
    """The model's invariant products go with the invariant tree attention, and only with it."""
    from gyre_hpc.trees.attention import InvariantTreeAttention

    return {"invariant": True} if isinstance(attention_fn, InvariantTreeAttention) else {}

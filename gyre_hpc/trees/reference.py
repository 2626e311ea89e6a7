"""The reference the tree loss is tested against: call by call, on plain sequences.

Each call's ``prompt + output`` runs through the model as an ordinary causal sequence
(positions 0..n-1, no tree, no packing). Which tokens are targets is decided here
independently of the tree builder, by the plainest rule there is: a token-level trie of
dicts; a position is a target if some call generated it, counted once, with the
behaviour logprob of the first call in journal order that generated it. It is slow on
purpose and meant to run in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gyre_hpc.trees.loss import StepWeights, clipped_pg_loss
from gyre_hpc.trees.model import ModelCall


@dataclass(frozen=True)
class _Target:
    call: int
    position: int          # index into the call's prompt+output
    behaviour_logp: float


def reference_targets(journal: Sequence[ModelCall], kept: Sequence[int] | None = None) -> list[_Target]:
    """Every generated trie position on the kept calls' sequences, once, in journal order."""
    trie: dict = {}
    first_logp: dict[int, float] = {}
    walks = []
    for call in journal:
        node, walk = trie, []
        for p, tok in enumerate(np.concatenate([call.prompt, call.output]).tolist()):
            node = node.setdefault(tok, {})
            walk.append(node)
            if p >= call.prompt.size:
                first_logp.setdefault(id(node), float(call.logprobs[p - call.prompt.size]))
        walks.append(walk)
    counted: set[int] = set()
    targets = []
    for c in (range(len(journal)) if kept is None else sorted(kept)):
        for p, node in enumerate(walks[c]):
            key = id(node)
            if p > 0 and key in first_logp and key not in counted:
                counted.add(key)
                targets.append(_Target(c, p, first_logp[key]))
    return targets


def reference_loss(model: torch.nn.Module, journals: Sequence[Sequence[ModelCall]], rewards: Sequence[float],
                   task_ids: Sequence[str], clip_eps: float,
                   kept: Sequence[Sequence[int] | None] | None = None) -> tuple[torch.Tensor, StepWeights]:
    """The step loss computed call by call; also the StepWeights it implies."""
    kept = kept if kept is not None else [None] * len(journals)
    targets = [reference_targets(j, k) for j, k in zip(journals, kept)]
    weights = StepWeights.from_counts(rewards, task_ids, [len(t) for t in targets])
    dtype = next(model.parameters()).dtype
    total = torch.zeros((), dtype=dtype)
    for r, (journal, run_targets) in enumerate(zip(journals, targets)):
        by_call: dict[int, list[_Target]] = {}
        for t in run_targets:
            by_call.setdefault(t.call, []).append(t)
        for c, ts in by_call.items():
            seq = torch.from_numpy(np.concatenate([journal[c].prompt, journal[c].output]).astype(np.int64))[None]
            logits = model(seq, torch.arange(seq.shape[1])[None])[0]
            pos = torch.tensor([t.position for t in ts])
            logp = torch.log_softmax(logits[pos - 1], dim=-1).gather(-1, seq[0, pos][:, None])[:, 0]
            n = len(ts)
            total = total + clipped_pg_loss(
                logp,
                # The tree stores behaviour logprobs as float32; so does the journal.
                torch.tensor([t.behaviour_logp for t in ts], dtype=dtype),
                torch.full((n,), weights.advantages[r], dtype=dtype),
                torch.full((n,), weights.run_weight[r], dtype=dtype),
                clip_eps,
            )
    return total, weights

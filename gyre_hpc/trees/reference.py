"""The reference the tree loss is tested against: call by call, on plain sequences.

Each call's ``prompt + output`` runs through the model as an ordinary causal sequence
(positions 0..n-1, no tree, no packing). Which tokens are targets is decided here
independently of the tree builder, by the plainest rule there is: a token-level trie of
dicts, one entry per distinct prefix. Every generated token is a *sampling event* of the
prefix it ends; a prefix's multiplicity is the number of calls that sampled it.

* ``per_sample``: each sampling event is a target with its own call's behaviour logprob
  (the score-function gradient of a run sums over every sampling event);
* ``once``: each sampled prefix is one target, with the first sampling call's logprob.

With admission (``kept``), a prefix counts iff it lies on a kept call's sequence; every
sampling event of it counts then, also a left-out call's (the rule ``admit`` states). The
log-prob of a target is computed on the first kept call whose sequence holds the prefix.
It is slow on purpose and meant to run in float64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gyre_hpc.trees.loss import StepWeights, clipped_pg_loss
from gyre_hpc.trees.model import SHARED_TARGETS, ModelCall


@dataclass(frozen=True)
class _Target:
    call: int                            # the kept call whose sequence it is scored on
    position: int                        # index into that call's prompt+output
    behaviour_logps: tuple[float, ...]   # one per sampling event the rule trains
    sampled_by: tuple[int, ...]          # journal indices of the calls that sampled it

    @property
    def multiplicity(self) -> int:
        return len(self.behaviour_logps)


def reference_targets(journal: Sequence[ModelCall], kept: Sequence[int] | None = None,
                      shared_targets: str = "per_sample") -> list[_Target]:
    """Every sampled prefix on the kept calls' sequences, once, in journal order, with the
    sampling events the rule trains (see module docstring)."""
    if shared_targets not in SHARED_TARGETS:
        raise ValueError(f"shared_targets={shared_targets!r}: valid rules are {', '.join(SHARED_TARGETS)}")
    trie: dict = {}
    events: dict[int, list[tuple[int, float]]] = {}   # prefix -> [(call, behaviour logp)]
    walks = []
    for c, call in enumerate(journal):
        node, walk = trie, []
        for p, tok in enumerate(np.concatenate([call.prompt, call.output]).tolist()):
            node = node.setdefault(tok, {})
            walk.append(node)
            if p >= call.prompt.size:
                events.setdefault(id(node), []).append((c, float(call.logprobs[p - call.prompt.size])))
        walks.append(walk)
    counted: set[int] = set()
    targets = []
    for c in (range(len(journal)) if kept is None else sorted(kept)):
        for p, node in enumerate(walks[c]):
            key = id(node)
            if p > 0 and key in events and key not in counted:
                counted.add(key)
                ev = events[key] if shared_targets == "per_sample" else events[key][:1]
                targets.append(_Target(c, p, tuple(lp for _, lp in ev), tuple(k for k, _ in events[key])))
    return targets


def reference_loss(model: torch.nn.Module, journals: Sequence[Sequence[ModelCall]], rewards: Sequence[float],
                   task_ids: Sequence[str], clip_eps: float,
                   kept: Sequence[Sequence[int] | None] | None = None, shared_targets: str = "per_sample",
                   averaging: str = "run") -> tuple[torch.Tensor, StepWeights]:
    """The step loss computed call by call; also the StepWeights it implies."""
    kept = kept if kept is not None else [None] * len(journals)
    targets = [reference_targets(j, k, shared_targets) for j, k in zip(journals, kept)]
    weights = StepWeights.from_counts(rewards, task_ids, [sum(t.multiplicity for t in ts) for ts in targets],
                                      averaging)
    dtype = next(model.parameters()).dtype
    total = torch.zeros((), dtype=dtype)
    for r, (journal, run_targets) in enumerate(zip(journals, targets)):
        by_call: dict[int, list[_Target]] = {}
        for t in run_targets:
            by_call.setdefault(t.call, []).append(t)
        for c, ts in by_call.items():
            seq = torch.from_numpy(np.concatenate([journal[c].prompt, journal[c].output]).astype(np.int64))[None]
            logits = model(seq, torch.arange(seq.shape[1])[None])[0]
            # Multiplicity made explicit: a position's log-prob repeated once per trained event.
            pos = torch.tensor([t.position for t in ts for _ in t.behaviour_logps])
            logp = torch.log_softmax(logits[pos - 1], dim=-1).gather(-1, seq[0, pos][:, None])[:, 0]
            n = pos.numel()
            total = total + clipped_pg_loss(
                logp,
                # The tree stores behaviour logprobs as float32; so does the journal.
                torch.tensor([lp for t in ts for lp in t.behaviour_logps], dtype=dtype),
                torch.full((n,), weights.advantages[r], dtype=dtype),
                torch.full((n,), weights.run_weight[r], dtype=dtype),
                clip_eps,
            )
    return total, weights

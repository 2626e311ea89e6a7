"""Small journals with every shape the builder must handle, cheap enough for float64 references."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre_hpc.trees.model import ModelCall
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_journal

# Compressions, sub-agents, retries (half of them identical), empty outputs, in 30 calls.
SMALL = SyntheticConfig(
    n_calls=30, system_tokens=8, output_tokens=(0, 12), tool_tokens=(2, 16), context_limit=120,
    summary_tokens=(4, 10), n_subagents=(2, 3), subagent_calls=(2, 3), subagent_system_tokens=4,
    retry_prob=0.2, empty_output_prob=0.1)


def _lp(n, rng):
    return -rng.exponential(1.0, size=n).astype(np.float32)


def random_journal(seed: int, n_calls: int = 30) -> list[ModelCall]:
    """A synthetic long-horizon journal plus the awkward cases mixed in: a prompt sharing
    nothing with the rest (a second root), an identical retry with different logprobs, an
    output that a later prompt repeats as context elsewhere."""
    rng = np.random.default_rng(seed)
    cfg = SyntheticConfig(**{**SMALL.__dict__, "n_calls": n_calls})
    calls = synthetic_journal(cfg, seed=seed)
    # A fresh root: no shared first token (BOS starts every synthetic context).
    other = rng.integers(0, 256, size=6).astype(np.int32)
    out = rng.integers(0, 256, size=5).astype(np.int32)
    calls.insert(len(calls) // 3, ModelCall(other, out, _lp(5, rng), role="subagent", agent="x"))
    # Identical retry of an earlier call, other logprobs: must keep the first call's.
    c = calls[len(calls) // 2]
    calls.append(ModelCall(c.prompt, c.output, _lp(c.output.size, rng), role=c.role, agent=c.agent))
    # The root call's output quoted in a new context after other text: context, not a target.
    calls.append(ModelCall(np.concatenate([other[:2], [7, 7], out]), rng.integers(0, 256, 3), _lp(3, rng)))
    return calls


@pytest.fixture(autouse=True)
def _one_thread():
    """Tree tests are small; one thread keeps them from fighting the rest of the suite for 2 cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_journal():
    """random_journal as a fixture, so test modules need no import path to this file."""
    return random_journal


def coincidence_journal(seed: int, n_calls: int = 25, alphabet: int = 3) -> list[ModelCall]:
    """Short calls over a 3-token alphabet, each prompt a random prefix of an earlier
    sequence plus a few random tokens: outputs coincide with other calls' prompt tokens
    and with each other at the same trie positions all the time."""
    rng = np.random.default_rng(seed)
    seqs: list[np.ndarray] = []
    calls = []
    for _ in range(n_calls):
        if seqs and rng.random() < 0.8:
            base = seqs[rng.integers(len(seqs))]
            prompt = np.concatenate([base[:rng.integers(1, base.size + 1)], rng.integers(0, alphabet, rng.integers(0, 3))])
        else:
            prompt = rng.integers(0, alphabet, rng.integers(1, 4))
        output = rng.integers(0, alphabet, rng.integers(0, 5))
        calls.append(ModelCall(prompt.astype(np.int32), output, _lp(output.size, rng),
                               role=("main", "subagent", "summary")[rng.integers(3)]))
        seqs.append(np.concatenate([prompt, output]).astype(np.int32))
    return calls


@pytest.fixture
def make_coincidences():
    return coincidence_journal

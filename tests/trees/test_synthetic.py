from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from gyre_hpc.models.tiny_lm import BOS_ID
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_journal, synthetic_runs


def _seq(c):
    return np.concatenate([c.prompt, c.output])


def test_default_journal_is_long_horizon_shaped():
    cfg = SyntheticConfig()
    journal = synthetic_journal(cfg, seed=3)
    assert len(journal) == cfg.n_calls == 200
    roles = Counter(c.role for c in journal)
    agents = {c.agent for c in journal if c.role == "subagent"}
    assert roles["summary"] >= 5 and roles["main"] > 100
    assert cfg.n_subagents[0] <= len(agents) <= cfg.n_subagents[1]
    # The context is compressed when it passes the limit, so no prompt is far beyond it.
    longest = max(c.prompt.size for c in journal)
    assert cfg.context_limit < longest <= cfg.context_limit + cfg.output_tokens[1] + cfg.tool_tokens[1]
    assert all(c.prompt[0] == BOS_ID for c in journal)


def test_contexts_grow_by_outputs_and_tool_text():
    journal = synthetic_journal(SyntheticConfig(retry_prob=0.0, n_subagents=(0, 0)), seed=1)
    mains = [c for c in journal if c.role == "main"]
    grown = sum(np.array_equal(b.prompt[:a.prompt.size + a.output.size], _seq(a)) and b.prompt.size > _seq(a).size
                for a, b in zip(mains, mains[1:]))
    assert grown >= len(mains) - 20  # all but the steps across a compression


def test_summary_output_opens_the_next_main_context():
    journal = synthetic_journal(SyntheticConfig(retry_prob=0.0), seed=2)
    summaries = [i for i, c in enumerate(journal[:-1]) if c.role == "summary"]
    assert len(summaries) >= 5
    for i in summaries:
        c, nxt = journal[i], next(d for d in journal[i + 1:] if d.role == "main")
        np.testing.assert_array_equal(nxt.prompt, np.concatenate([journal[0].prompt[:48], c.output]))


def test_retries_branch_from_earlier_contexts_sometimes_identically():
    journal = synthetic_journal(SyntheticConfig(retry_prob=0.3, identical_retry_prob=0.5), seed=4)
    seqs = [_seq(c).tobytes() for c in journal]
    prompts = Counter(c.prompt.tobytes() for c in journal)
    assert max(prompts.values()) >= 2  # some context was sampled from more than once
    assert len(set(seqs)) < len(seqs)  # and some retry regenerated the same output
    tree = build_tree(journal)
    assert tree.n_tokens < sum(len(s) for s in seqs) / 3


def test_same_seed_same_journal_and_runs_form_task_groups():
    a, b = synthetic_journal(seed=9), synthetic_journal(seed=9)
    assert all(np.array_equal(_seq(x), _seq(y)) and np.array_equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    small = replace(SyntheticConfig(), n_calls=20)
    runs = synthetic_runs(n_tasks=2, runs_per_task=3, cfg=small, seed=0)
    assert [r.task_id for r in runs] == ["task0"] * 3 + ["task1"] * 3
    assert len({r.run_id for r in runs}) == 6 and all(0.0 <= r.reward <= 1.0 for r in runs)
    assert all(len(r.journal) == 20 for r in runs)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="output_tokens"):
        SyntheticConfig(output_tokens=(5, 2))
    with pytest.raises(ValueError, match="retry_prob"):
        SyntheticConfig(retry_prob=1.5)
    with pytest.raises(ValueError, match="context_limit"):
        SyntheticConfig(context_limit=50)

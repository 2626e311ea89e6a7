"""Synthetic harness journals shaped like long-horizon agent runs, for tests and benches.

A run here is what the harness would journal, without a model: the main agent's context
grows by its own outputs and by tool outputs; past ``context_limit`` tokens a summary call
compresses it and the main agent continues from a fresh context holding the summary; a
few sub-agents work in their own contexts and hand their last answer back as tool text;
now and then a retry branches from an earlier main context (the failed branch is
abandoned), sometimes regenerating the very same output. Tokens are random bytes; what
matters is the sharing structure, which is what the tree builder and packer exploit.

Every knob is a field of :class:`SyntheticConfig`; all randomness comes from one seed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre_hpc.models.tiny_lm import BOS_ID
from gyre_hpc.trees.model import ModelCall


@dataclass(frozen=True)
class SyntheticConfig:
    n_calls: int = 200                   # model calls in a run, all roles together
    system_tokens: int = 48              # system prompt + task spec opening every main context
    output_tokens: tuple[int, int] = (8, 48)     # output length range per call (inclusive)
    tool_tokens: tuple[int, int] = (16, 96)      # tool output appended after a main call
    context_limit: int = 1024            # main context length that triggers a summary call
    summary_tokens: tuple[int, int] = (24, 64)   # summary output length range
    n_subagents: tuple[int, int] = (2, 4)        # sub-agents delegated to per run
    subagent_calls: tuple[int, int] = (3, 8)     # calls each sub-agent makes
    subagent_system_tokens: int = 24     # sub-agent's own system prompt
    retry_prob: float = 0.05             # chance a main call is a retry from an earlier context
    retry_back: tuple[int, int] = (1, 4)  # how many main calls back a retry branches from
    identical_retry_prob: float = 0.5    # chance a retry regenerates the identical output
    empty_output_prob: float = 0.02      # chance a call outputs nothing (e.g. hit a stop at once)

    def __post_init__(self) -> None:
        for name in ("output_tokens", "tool_tokens", "summary_tokens", "n_subagents", "subagent_calls", "retry_back"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"SyntheticConfig.{name}={getattr(self, name)} must be a range 0 <= lo <= hi")
        for name in ("retry_prob", "identical_retry_prob", "empty_output_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SyntheticConfig.{name}={getattr(self, name)} must lie in [0, 1]")
        if self.n_calls < 1 or self.system_tokens < 1 or self.subagent_system_tokens < 1:
            raise ValueError("SyntheticConfig.n_calls, system_tokens and subagent_system_tokens must be >= 1")
        if self.context_limit <= self.system_tokens + self.summary_tokens[1]:
            raise ValueError(
                f"SyntheticConfig.context_limit={self.context_limit} must exceed system_tokens + the longest summary")


@dataclass(frozen=True)
class SyntheticRun:
    journal: list[ModelCall]
    run_id: str
    task_id: str
    reward: float


class _Journal:
    """The state of one synthetic run while its calls are generated."""

    def __init__(self, cfg: SyntheticConfig, rng: np.random.Generator):
        self.cfg, self.rng = cfg, rng
        self.calls: list[ModelCall] = []

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, 256, size=n, dtype=np.int32)

    def length(self, lo_hi: tuple[int, int]) -> int:
        return int(self.rng.integers(lo_hi[0], lo_hi[1] + 1))

    def call(self, prompt: np.ndarray, role: str, agent: str, n_out: int | None = None,
             output: np.ndarray | None = None) -> np.ndarray:
        if output is None:
            if n_out is None:
                n_out = 0 if self.rng.random() < self.cfg.empty_output_prob else self.length(self.cfg.output_tokens)
            output = self.tokens(n_out)
        logprobs = -self.rng.exponential(1.0, size=output.size).astype(np.float32)
        self.calls.append(ModelCall(prompt=prompt, output=output, logprobs=logprobs, role=role, agent=agent))
        return output


def synthetic_journal(cfg: SyntheticConfig = SyntheticConfig(), seed: int = 0) -> list[ModelCall]:
    """One run's journal of ``cfg.n_calls`` calls (see the module docstring for its shape)."""
    rng = np.random.default_rng(seed)
    j = _Journal(cfg, rng)
    system = np.concatenate([[BOS_ID], j.tokens(cfg.system_tokens - 1)]).astype(np.int32)
    context = system
    history: list[tuple[np.ndarray, np.ndarray]] = []  # (prompt, output) of earlier main calls

    n_sub = j.length(cfg.n_subagents)
    sub_budget = [j.length(cfg.subagent_calls) for _ in range(n_sub)]
    # Spread delegations over the run; each costs its calls plus the main call that follows.
    main_budget = max(1, cfg.n_calls - sum(sub_budget))
    delegate_at = set(rng.choice(np.arange(1, max(2, main_budget)), size=min(n_sub, max(1, main_budget - 1)),
                                 replace=False).tolist()) if n_sub else set()
    sub_index = 0
    main_calls = 0

    while len(j.calls) < cfg.n_calls:
        if context.size > cfg.context_limit:
            summary = j.call(context, "summary", "main", n_out=j.length(cfg.summary_tokens))
            # The summary's tokens reappear at the top of a fresh context: a new root, context only.
            context = np.concatenate([system, summary])
            history.clear()
            continue
        if history and rng.random() < cfg.retry_prob:
            back = min(len(history), max(1, j.length(cfg.retry_back)))
            branch = len(history) - back
            prompt, old_output = history[branch]
            del history[branch + 1:]  # the abandoned branch's later calls are no longer context
            same = rng.random() < cfg.identical_retry_prob
            output = j.call(prompt, "main", "main", output=old_output.copy() if same else None)
            history[-1] = (prompt, output)
            context = np.concatenate([prompt, output, j.tokens(j.length(cfg.tool_tokens))])
            continue
        output = j.call(context, "main", "main")
        history.append((context, output))
        main_calls += 1
        if main_calls in delegate_at and sub_index < n_sub and len(j.calls) < cfg.n_calls:
            answer = _run_subagent(j, output, f"sub{sub_index}", sub_budget[sub_index])
            sub_index += 1
            tool = answer
        else:
            tool = j.tokens(j.length(cfg.tool_tokens))
        context = np.concatenate([context, output, tool])
    return j.calls[:cfg.n_calls]


def _run_subagent(j: _Journal, task: np.ndarray, agent: str, n_calls: int) -> np.ndarray:
    """A sub-agent: its own context (own system prompt + the delegated task), its own tool loop."""
    cfg = j.cfg
    context = np.concatenate([[BOS_ID], j.tokens(cfg.subagent_system_tokens - 1), task]).astype(np.int32)
    answer = np.zeros(0, dtype=np.int32)
    for _ in range(n_calls):
        if len(j.calls) >= cfg.n_calls:
            break
        answer = j.call(context, "subagent", agent)
        context = np.concatenate([context, answer, j.tokens(j.length(cfg.tool_tokens))])
    return answer


def synthetic_runs(n_tasks: int = 2, runs_per_task: int = 4, cfg: SyntheticConfig = SyntheticConfig(),
                   seed: int = 0) -> list[SyntheticRun]:
    """A step's worth of runs: ``runs_per_task`` runs (the advantage group) of each task."""
    rng = np.random.default_rng(seed)
    runs = []
    for t in range(n_tasks):
        for r in range(runs_per_task):
            journal = synthetic_journal(cfg, seed=int(rng.integers(2**31)))
            reward = float(rng.integers(0, 5)) / 4  # fraction of 4 tests passed
            runs.append(SyntheticRun(journal=journal, run_id=f"task{t}-run{r}", task_id=f"task{t}", reward=reward))
    return runs

"""The endpoint's sessions: one agent run of an outside scaffold, its token context and its journal.

Why a session is a key: a scaffold is the user's unmodified code, and the one thing every
OpenAI client can be given per run is its API key (``OPENAI_API_KEY``), or a header. The
controller opens a session per run (``SessionRegistry.open``) and hands the key to the
scaffold; the endpoint never creates one on request, so a typo or a finished run's key is an
error, not a new run.

A session's calls are journaled with ``JournalWriter`` exactly as the harness's own runs are
(one journal per run, each call an increment of the call its prompt starts with), so the tree
builder, admission and training read a scaffold's run as any other.
"""
from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gyre_hpc.harness.client import ModelClient
from gyre_hpc.harness.journal import JournalWriter
from gyre_hpc.harness.openai_schema import APIError
from gyre_hpc.harness.session_context import PromptPlan, SessionCall
from gyre_hpc.trees.calls import CallIncrement
from gyre_hpc.trees.model import ModelCall


@dataclass
class SessionStats:
    """What a run's calls did to its context, and what the endpoint cost per call."""

    calls: int = 0
    extends: int = 0          # prompt = the previous call's prompt + sampled ids + new turns
    branches: int = 0         # based on an earlier call than the previous one, or mid-way through it
    retries: int = 0
    renders: int = 0          # rendered fresh (no call's reply was found intact)
    drift: int = 0            # rebuilt replies whose ids differ from the sampled ones
    overhead_s: list[float] = field(default_factory=list)   # time in the endpoint per call, engine excluded
    engine_s: list[float] = field(default_factory=list)
    journal_s: list[float] = field(default_factory=list)    # of overhead_s: the journal's write + fsync

    def as_dict(self) -> dict:
        over, journal = self.overhead_s, self.journal_s
        return {"calls": self.calls, "extends": self.extends, "branches": self.branches, "retries": self.retries,
                "renders": self.renders, "drift": self.drift,
                "overhead_ms_mean": 1e3 * float(np.mean(over)) if over else None,
                "overhead_ms_p50": 1e3 * float(np.median(over)) if over else None,
                "overhead_ms_max": 1e3 * float(np.max(over)) if over else None,
                "journal_ms_mean": 1e3 * float(np.mean(journal)) if journal else None}


class Session:
    """One run: its client (the run's seed), chat calls, journal and counters. Calls of one
    session are serialized (``lock``): each is planned against the calls before it.

    The run's budgets are enforced here as well as by whoever runs the scaffold: a call past
    ``max_calls`` is refused and sets ``spent`` (the runner then kills the scaffold), a call
    past ``deadline`` (``time.monotonic``) is cut, and a ``closed`` session takes no call."""

    def __init__(self, key: str, run_id: str, client: ModelClient, journal: JournalWriter,
                 max_calls: int | None = None, deadline: float | None = None) -> None:
        self.key, self.run_id, self.client, self.journal = key, run_id, client, journal
        self.max_calls, self.deadline = max_calls, deadline
        self.chat_calls: list[SessionCall] = []
        self._journal_index: list[int] = []      # chat call i is journal call _journal_index[i]
        self.stats = SessionStats()
        self.lock = asyncio.Lock()
        self.spent = asyncio.Event()
        self.closed = False

    def admit(self) -> None:
        """Raise the OpenAI-style error for a call this session may not make now."""
        if self.closed:
            raise APIError(404, f"run {self.run_id} has ended; its session takes no more calls",
                           code="session_not_found")
        if self.max_calls is not None and self.stats.calls >= self.max_calls:
            self.spent.set()
            raise APIError(429, f"run {self.run_id}'s turn budget of {self.max_calls} model calls is spent",
                           type="requests", code="turn_budget_spent")
        if self.time_left() is not None and self.time_left() <= 0:
            raise APIError(408, f"run {self.run_id}'s wall clock has run out", type="timeout_error", code="run_timeout")

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def record_chat(self, plan: PromptPlan, call: SessionCall, logprobs, policy_version: int) -> int:
        """Journal a chat call as the plan built it; returns its journal index."""
        base = self._journal_index[plan.base] if plan.base >= 0 else -1
        k = self._record(CallIncrement(base, plan.shared, np.asarray(plan.prompt[plan.shared:]), np.asarray(call.output),
                                       np.asarray(logprobs), policy_version=policy_version))
        last = len(self.chat_calls) - 1
        s = self.stats
        if plan.kind == "retry":
            s.retries += 1
        elif plan.kind == "extend" and plan.base == last:
            s.extends += 1
        else:
            s.renders += plan.kind == "render"
            s.branches += plan.base >= 0 and not (plan.base == last and plan.shared == len(self.chat_calls[last].seq))
        s.drift += plan.drift
        self.chat_calls.append(call)
        self._journal_index.append(k)
        return k

    def record_tokens(self, prompt, output, logprobs, policy_version: int) -> int:
        """Journal a token-id completion, based on whichever recent call shares most with it."""
        return self._record(self.journal.log.increment_for(ModelCall(np.asarray(prompt), np.asarray(output),
                                                                     np.asarray(logprobs),
                                                                     policy_version=policy_version)))

    def _record(self, inc: CallIncrement) -> int:
        t = time.perf_counter()
        self.journal.append(inc)
        self.stats.journal_s.append(time.perf_counter() - t)
        self.stats.calls += 1
        return len(self.journal.log) - 1


class SessionRegistry:
    """The open sessions by key."""

    def __init__(self) -> None:
        self._by_key: dict[str, Session] = {}

    def open(self, run_id: str, client: ModelClient, journal_path: str | Path, task_id: str = "external",
             key: str | None = None, max_calls: int | None = None, deadline: float | None = None) -> Session:
        key = key or f"gyre-{secrets.token_urlsafe(18)}"
        if key in self._by_key:
            raise ValueError(f"session key {key!r} is already open (run {self._by_key[key].run_id})")
        session = Session(key, run_id, client, JournalWriter.create(journal_path, run_id, task_id), max_calls, deadline)
        self._by_key[key] = session
        return session

    def get(self, key: str) -> Session | None:
        return self._by_key.get(key)

    def close(self, key: str) -> Session:
        """Forget a session (its run ended); the caller ends its journal with the run's reward."""
        return self._by_key.pop(key)

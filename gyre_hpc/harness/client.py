"""How the harness talks to a policy: one awaitable call per model request.

Why asyncio: the controller drives many runs at once (G runs per task, several tasks) on
one thread; each run awaits its model calls, so requests from all runs reach the engine
together and batch, while tools (commands, tests) run in worker threads. A client only has
to implement ``complete``; ``EngineCalls`` (engine_client.py) adapts an engine, and its
``client(run_seed)`` is the ``RunClient`` one run calls.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Completion:
    output: tuple[int, ...]       # sampled token ids (a stop token, if hit, is the last one)
    logprobs: tuple[float, ...]   # behaviour logprob of each output token
    policy_version: int = 0

    def __post_init__(self) -> None:
        if len(self.output) != len(self.logprobs):
            raise ValueError(f"Completion has {len(self.logprobs)} logprobs for {len(self.output)} tokens")


@runtime_checkable
class ModelClient(Protocol):
    async def complete(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], *,
                       agent: str = "main") -> Completion:
        """Continue ``prompt`` by at most ``max_new_tokens``, stopping after any id in ``stop``.
        ``agent`` names the context the call continues (``main``, ``sub1``, ...): each
        agent's prompts extend its previous prompt + output, so a client may keep that
        context's KV between its calls (the RL router does, per run and agent)."""
        ...

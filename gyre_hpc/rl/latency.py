"""Added environment latency for tool calls (``rollout.tool_latency_s``), as a harness run subclass.

Why: on a laptop-sized machine a tiny model's tools return in milliseconds, so the idle
engine time the elastic scheduler exists to reclaim never appears. Real agent runs spend
most of their wall time in tools between model calls. The latency is drawn lognormal per
(run seed, call index), so every policy of a benchmark sees the same waits, and is added only
when another model call follows (the run's last tool result goes straight to scoring), which
is where the simulator (``gyre_hpc.sim``) places tool time too.
"""
from __future__ import annotations

import asyncio
import hashlib
import math
from statistics import NormalDist

from gyre_hpc.harness.actions import Action
from gyre_hpc.harness.loop import AgentRun


def latency_s(run_seed: int, call: int, median_s: float, sigma: float) -> float:
    """Deterministic lognormal draw for call ``call`` of the run seeded ``run_seed``."""
    digest = hashlib.blake2b(f"{run_seed}/{call}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") + 0.5) / 2 ** 64
    return median_s * math.exp(sigma * NormalDist().inv_cdf(u))


class LatencyAgentRun(AgentRun):
    def __init__(self, *args, run_seed: int, median_s: float, sigma: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_seed, self.median_s, self.sigma = run_seed, median_s, sigma
        self.added_s = 0.0

    async def _execute(self, action: Action, agent: str) -> tuple[str, bool]:
        result = await super()._execute(action, agent)
        finished = result[1]
        last_turn = agent == "main" and self.calls.count("main", "main") >= self.task.max_turns
        if not finished and not last_turn:
            wait = latency_s(self.run_seed, len(self.calls), self.median_s, self.sigma)
            self.added_s += wait
            await asyncio.sleep(min(wait, max(self._remaining(), 0.0)))
        return result

"""Adapt an engine (``submit``/``step``/``pop_finished``) to the harness's ModelClient.

One ``EngineCalls`` owns one engine on the event loop's thread: runs submit requests as
they await, and a single pump task steps the engine while any request waits, so the
requests of all concurrent runs decode in one continuous batch. Stepping happens on the
loop's thread (engines are not thread-safe); the pump yields between steps so runs can
submit. Each run gets its own ``RunClient`` whose sampling seed for a call derives from the
run's seed and the prompt itself, so a run's samples do not depend on how runs interleave
or on a resume (a replayed run asks for the same seeds), and G runs of one task (same first
prompt, different run seeds) explore differently.
It assumes it is the engine's only user: finished outputs nobody waits for (a run
that timed out) are dropped.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections.abc import Sequence

import numpy as np

from gyre_hpc.engines.base import Engine
from gyre_hpc.engines.requests import Output, Request, SamplingParams
from gyre_hpc.harness.client import Completion


class EngineCalls:
    def __init__(self, engine: Engine, temperature: float = 1.0, top_p: float = 1.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self.top_p = top_p
        self._waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._pump: asyncio.Task | None = None

    def client(self, run_seed: int) -> "RunClient":
        return RunClient(self, run_seed)

    async def generate(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], seed: int) -> Output:
        rid = f"harness-{next(self._ids)}"
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                seed=seed, stop_token_ids=tuple(stop))
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        self.engine.submit(Request(rid, tuple(int(t) for t in prompt), params))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run_pump())
        try:
            return await fut
        finally:
            self._waiting.pop(rid, None)

    async def _run_pump(self) -> None:
        while self._waiting:
            try:
                self.engine.step()
                finished = self.engine.pop_finished()
            except Exception as exc:  # noqa: BLE001 - every waiting run learns why, none hangs
                for fut in self._waiting.values():
                    if not fut.done():
                        fut.set_exception(exc)
                return
            for out in finished:
                fut = self._waiting.get(out.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(out)
            await asyncio.sleep(0)


def call_seed(run_seed: int, prompt: Sequence[int]) -> int:
    """A call's sampling seed: a hash of (run seed, prompt), so a replay of the run (a resume,
    or ``bench xlong`` replaying its journal) asks for the seeds the live run asked for."""
    digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int32).tobytes(), digest_size=8,
                             key=str(run_seed).encode()).digest()
    return int.from_bytes(digest, "little") >> 1


class RunClient:
    """The ModelClient one run uses; a call's seed is ``call_seed`` (run seed, prompt)."""

    def __init__(self, calls: EngineCalls, run_seed: int) -> None:
        self.source = calls
        self.run_seed = run_seed

    def seed_for(self, prompt: Sequence[int]) -> int:
        return call_seed(self.run_seed, prompt)

    async def complete(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], *,
                       agent: str = "main") -> Completion:
        seed = self.seed_for(prompt)
        out = await self.source.generate(prompt, max_new_tokens, stop, seed)
        return Completion(tuple(out.token_ids), tuple(out.logprobs), out.policy_version)

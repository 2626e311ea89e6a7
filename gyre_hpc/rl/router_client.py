"""The harness's model client over the router: runs on the controller's event loop call
engines on other ranks.

``RoutedCalls.generate`` queues a request and awaits a future; the controller routes the
queue (``dispatch``, least outstanding tokens; while an engine is returning, new contexts wait
for it), and its pump (``pump``) polls the router between harness steps and resolves the
futures, so MPI is pumped on the loop's thread while tool calls run in worker threads. Seeds
come from ``harness.engine_client.RunClient`` (a hash of run seed and prompt), so a replayed or
resumed run asks for the same samples.

Per run it counts migrations (from each ``Output``) and restarts: a request of the run
routed to an engine a second time, i.e. a model call begun again from scratch (what a flip
without KV migration would do to the requests in flight). The harness asking twice for the
same context (two identical sub-agent briefs) is not one: the seed of a prompt is fixed,
so the second ask is answered identically and on purpose.

Each call names its session, ``<run id>/<agent>`` (``session_of``): the run's main agent and
each sub-agent are separate contexts, so a sub-agent's calls do not evict the main agent's
retained KV. The engine that served a session's last call keeps its context and the router
sends the next call there; ``RLStepDriver`` forgets a run's sessions when the run ends.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Sequence

from gyre_hpc.engines.requests import Output, Request, SamplingParams
from gyre_hpc.engines.router import Router
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.engine_client import RunClient
from gyre_hpc.rl.policy_inputs import run_of_request


def session_of(run_id: str, agent: str) -> str:
    """The engine session of one agent context of a run."""
    return f"{run_id}/{agent}"


def sessions_of_run(sessions, run_id: str) -> list[str]:
    """The sessions among ``sessions`` that belong to run ``run_id``."""
    prefix = session_of(run_id, "")
    return [s for s in sessions if s.startswith(prefix)]


class RoutedCalls:
    def __init__(self, router: Router, temperature: float = 1.0, top_p: float = 1.0):
        self.router = router
        self.temperature = temperature
        self.top_p = top_p
        self._waiting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self.prompt_tokens = 0      # prompt tokens submitted (each must be prefilled exactly once)
        self.started: set[str] = set()   # requests that produced a token (prefilled)
        # Requests wait here until the next ``dispatch``; those that open a context wait
        # longer while engines are coming back (``dispatch(hold_new=True)``), so a burst of
        # new runs (a batch starting) does not all land on the engines that happen to be open.
        self.queue: list[Request] = []
        self._routed: set[str] = set()
        self._session: dict[str, str] = {}   # request id -> its session, until it finishes
        self.restarts: Counter = Counter()   # run tag -> requests routed again

    def client(self, run_id: str, run_seed: int) -> "CountingRunClient":
        return CountingRunClient(self, run_seed, run_id)

    async def generate(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], seed: int,
                       tag: str = "r", session: str | None = None) -> Output:
        rid = f"{tag}-{next(self._ids)}"
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                seed=seed, stop_token_ids=tuple(stop))
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        request = Request(rid, tuple(int(t) for t in prompt), params, session=session)
        self.queue.append(request)
        self.prompt_tokens += request.prompt_len
        if session is not None:
            self._session[rid] = session
        try:
            return await fut
        finally:
            self._waiting.pop(rid, None)
            self._routed.discard(rid)
            if request in self.queue:      # its caller is gone (a wall clock) before routing: not sent
                self.queue.remove(request)
                self.prompt_tokens -= request.prompt_len
                self._session.pop(rid, None)

    def dispatch(self, hold_new: bool = False) -> int:
        """Route the queued requests (least outstanding tokens); returns how many.

        ``hold_new``: an engine is on its way (a flip to ROLLOUT in flight), so a request that
        would open a context (its session has no home engine yet) waits for it. Routed now,
        it would go to an engine open now and stay there, with every later call of its run
        (affinity): a batch starting at an update while the split's engine returns put all
        its runs on the engine that stayed (measured: 45 against 0 for 15 s, docs/rl.md).
        A call whose context is held somewhere goes there as always."""
        routed, held = 0, []
        for request in self.queue:
            if hold_new and (request.session is None or self.router.session_home(request.session) is None):
                held.append(request)
                continue
            if request.request_id in self._routed:
                self.restarts[run_of_request(request.request_id)] += 1
            self._routed.add(request.request_id)
            self.router.submit(request)
            routed += 1
        self.queue = held
        return routed

    def pump(self) -> int:
        """Poll the engines once; resolve finished requests. Returns token events seen."""
        events = self.router.poll()
        for ev in events:
            if ev.index == 0:
                self.started.add(ev.request_id)
        for out in self.router.pop_finished():
            self.started.discard(out.request_id)
            session = self._session.pop(out.request_id, None)
            fut = self._waiting.get(out.request_id)
            if fut is not None and not fut.done():
                fut.set_result(out)
            elif session is not None:
                # Nobody waits for it: the run's wall clock cancelled the call, and the run
                # ended (forgetting its contexts) while the engine still decoded it. The
                # context the engine kept at the finish belongs to no live run: drop it now
                # rather than hold memory until LRU eviction.
                self.router.forget([session])
        return len(events)

    def forget_run(self, run_id: str) -> int:
        """Drop the retained contexts of a run that ended; returns how many there were."""
        return self.router.forget(sessions_of_run(self.router.sessions, run_id))

    def fail_all(self, exc: BaseException) -> None:
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(exc)

    @property
    def waiting(self) -> int:
        return len(self._waiting)


class CountingRunClient(RunClient):
    def __init__(self, calls: RoutedCalls, run_seed: int, run_id: str):
        super().__init__(calls, run_seed)
        self.run_id = run_id
        self.migrations = 0
        self.calls = 0
        self.model_s = 0.0         # wall time spent waiting on model calls

    @property
    def restarts(self) -> int:
        return self.source.restarts[self.run_id]

    async def complete(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], *,
                       agent: str = "main") -> Completion:
        t0 = time.monotonic()
        out = await self.source.generate(prompt, max_new_tokens, stop, self.seed_for(prompt), tag=self.run_id,
                                         session=session_of(self.run_id, agent))
        self.model_s += time.monotonic() - t0
        self.calls += 1
        self.migrations += out.migrations
        return Completion(tuple(out.token_ids), tuple(out.logprobs), out.policy_version)

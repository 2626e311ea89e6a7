"""The ROLLOUT cells' engines as the controller rank holds them: which serve loops run,
their counters, and the weight push into them.

An engine's rank answers either its engine's requests (its serve loop) or fleet commands,
never both: an engine is paused before its rank takes part in a flip or a checkpoint and
resumed after. Paused engines' counters and pace records are kept here because a paused
serve loop no longer answers ``stats``.
"""
from __future__ import annotations

import time

from gyre_hpc.cells.controller import Controller
from gyre_hpc.cells.plan import core_cell
from gyre_hpc.engines.mpi_engines import MPIEngines
from gyre_hpc.engines.router import Router
from gyre_hpc.rl import messages
from gyre_hpc.sched.state import Role


class CountingEngines(MPIEngines):
    """MPIEngines that also counts each engine's decoded tokens (its measured throughput)
    and the prefill it did beyond first prefills, and can pause an engine's serve loop so
    its rank can join a world-wide collective.

    Recomputed prefill: every engine reports its cumulative ``prefill_tokens`` with the
    events of the same decode step, and a request's first prefill is the step that produced
    its token 0. A prompt's tokens reach a cache either through the model (``prefill_tokens``)
    or from its session's retained context (``cached_prompt_tokens``), each exactly once for
    a request that starts and finishes on one engine. So (sum of the engines' prefill +
    cached) - (prompt tokens of the requests whose token 0 was seen) is exactly the prefill
    done again: a moved sequence whose cache did not travel re-fills prompt + output without
    a token 0. Valid for engines that prefill a prompt in the step that samples its first
    token (TorchEngine without a prefill budget)."""

    def __init__(self, comm, ranks, poll_timeout_s: float = 0.0, reply_timeout_s: float = 600.0):
        super().__init__(comm, ranks, poll_timeout_s, reply_timeout_s)
        self.tokens = {e: 0 for e in self.ranks}
        self.prefill = {e: 0 for e in self.ranks}     # engine -> cumulative prefill tokens reported
        self.cached = {e: 0 for e in self.ranks}      # engine -> cumulative prompt tokens served from retained contexts
        self.first_prefill = 0                        # prompt tokens of requests whose token 0 was seen
        self._prompt_len: dict[str, int] = {}         # submitted, token 0 not seen yet

    def submit(self, engine: int, request) -> None:
        self._prompt_len[request.request_id] = request.prompt_len
        super().submit(engine, request)

    def poll(self):
        reports = super().poll()
        for r in reports:
            self.tokens[r.engine] += len(r.events)
            if r.prefill_tokens >= 0:
                self.prefill[r.engine] = r.prefill_tokens
            if r.cached_prompt_tokens >= 0:
                self.cached[r.engine] = r.cached_prompt_tokens
            for ev in r.events:
                if ev.index == 0:
                    self.first_prefill += self._prompt_len.pop(ev.request_id, 0)
        return reports

    @property
    def recomputed_prefill_tokens(self) -> int:
        return sum(self.prefill.values()) + sum(self.cached.values()) - self.first_prefill

    def pause(self, engines) -> dict:
        """Each paused engine's counters (the ``stop`` reply)."""
        return {e: self.call(e, "stop") for e in engines}


class EnginePool:
    def __init__(self, fleet: Controller, engine_comm):
        self.fleet = fleet
        self.transport = CountingEngines(engine_comm, {c.id: c.leader for c in fleet.cells},
                                         reply_timeout_s=fleet.reply_timeout_s)
        self.router = Router(self.transport, [c.id for c in fleet.cells if c.role is Role.ROLLOUT])
        self.serving: set[int] = set()
        self.pace: dict[int, dict | None] = {}     # cell -> its engine's last pace record
        self.counters: dict[int, object] = {}      # engine -> counters at its last pause
        self.push_s: float | None = None           # the latest measured weight broadcast to the engines
        self.pushed: frozenset[int] = frozenset()   # the engines the latest push reached
        self._recomputed_mark = 0                  # recomputed prefill counted in earlier steps
        self._paced = fleet.cfg.cells.device == "paced"

    def resume(self) -> None:
        """Open the serve loop of every ROLLOUT cell not serving (after a flip, at the start)."""
        opening = [c for c in self.fleet.cells if c.role is Role.ROLLOUT and c.id not in self.serving]
        for c in opening:
            self.fleet.send(c.leader, messages.Serve(self.fleet.policy_version))
        self.fleet.collect([c.leader for c in opening])     # each acks, then serves its engine
        for c in opening:
            self.transport.resume(c.id)
            self.serving.add(c.id)

    def pause(self, engines: list[int] | None = None) -> None:
        """Stop these engines' serve loops (default: all serving) so their ranks take fleet commands."""
        engines = sorted(self.serving if engines is None else engines)
        if self._paced:
            for cid in engines:   # the engine's pace record, while its serve loop still answers
                self.pace[cid] = self.transport.stats(cid).get("pace")
        self.counters.update(self.transport.pause(engines))
        self.serving -= set(engines)

    def pace_records(self) -> dict[int, dict]:
        """Every engine's pace record so far (paced cells): the serving ones asked now."""
        for cid in sorted(self.serving):
            self.pace[cid] = self.transport.stats(cid).get("pace")
        return {cid: rec for cid, rec in sorted(self.pace.items()) if rec is not None}

    def push_weights(self, step: int, version: int) -> int:
        """The core leader broadcasts the new weights into every serving engine (one chunked
        broadcast, in place, not through this rank); returns the bytes each received."""
        engines = sorted(e for e in self.router.engines if e in self.serving)
        self.pushed = frozenset(engines)
        if not engines:
            return 0
        members = (core_cell(self.fleet.cells).leader,) + tuple(self.fleet.cell(e).leader for e in engines)
        core = members[0]
        t0 = time.perf_counter()
        self.fleet.send(core, messages.PushWeights(step, version, members))
        got = self.transport.call_many({e: ("recv_weights", (version, members)) for e in engines})
        self.fleet.collect([core])
        self.push_s = time.perf_counter() - t0
        return int(next(iter(got.values()))["bytes"])

    def recomputed_since_last(self) -> int:
        """Prefill the engines did again since the last call (0 with KV migration)."""
        total = self.transport.recomputed_prefill_tokens
        recomputed, self._recomputed_mark = total - self._recomputed_mark, total
        return recomputed

    def prompt_totals(self, prompt_tokens: int) -> dict[str, int]:
        """The fleet's prompt-token totals once every engine is paused, against the
        ``prompt_tokens`` the runs asked for: tokens served from retained session contexts, and
        tokens prefilled more than once across engines (0 unless a migrated sequence was
        recomputed instead of continued from its KV cache)."""
        counters = self.counters.values()
        cached = sum(c.cached_prompt_tokens for c in counters)
        prefilled = sum(c.prefill_tokens for c in counters) + cached
        return {"recomputed_prefill_tokens": prefilled - prompt_tokens, "cached_prompt_tokens": cached}

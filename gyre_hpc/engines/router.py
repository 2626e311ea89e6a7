"""The request router: spreads model calls over the ROLLOUT engines and drains an engine by
migrating its in-flight sequences, KV cache included, to the others.

The router lives on the controller rank and owns the routing decisions; the engines may
live in the same process (``InProcessEngines``: tests, benchmarks, a laptop) or in cell
ranks (``gyre_hpc.engines.mpi_engines.MPIEngines``). Both implement the small
``EngineTransport`` protocol, so the decisions below are the same code either way.

Load is measured in outstanding tokens (``outstanding_tokens_of``: prompt tokens not yet
prefilled plus every request's remaining decode budget), not in request counts: agent calls
range from a 50-token tool reply to a 30K-token context, and counting requests would pile
the long ones onto one engine. The router keeps its own book from what it submitted and the
token events it saw, so choosing an engine costs no round trip to the cells.

Sessions (``Request.session``, an agent context): the engine that finished a session's last
call keeps its context's KV (``TorchEngine``), so the session's next call goes back there
(affinity) while that engine is active, and prefills only its new tokens. A drain moves the
engine's retained contexts along with its in-flight requests, so a released engine costs
no run a re-prefill of its whole context; ``forget`` drops the contexts of a finished run.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol

from gyre_hpc.engines.base import Engine, outstanding_tokens_of
from gyre_hpc.engines.requests import Output, Request, TokenEvent


@dataclass(frozen=True)
class EngineReport:
    """What one engine produced since the last poll."""

    engine: int
    events: tuple[TokenEvent, ...] = ()
    outputs: tuple[Output, ...] = ()
    # The engine's cumulative ``prefill_tokens`` right after producing these events (-1: not
    # reported). Read with the events, a request's token 0 and the prefill behind it arrive
    # together, so prefill beyond the first-token prompts is exactly what was recomputed.
    prefill_tokens: int = -1
    cached_prompt_tokens: int = -1           # likewise the engine's ``cached_prompt_tokens``


@dataclass(frozen=True)
class MigrationResult:
    """What one drain moved."""

    source: int
    moved: Mapping[str, int]                 # request_id -> destination engine
    gone: tuple[str, ...] = ()               # finished on the source before they could move
    tokens_at_move: Mapping[str, int] = field(default_factory=dict)  # output tokens each moved sequence had on the source
    bytes: int = 0                           # KV cache bytes moved
    seconds: float = 0.0
    kv_tokens: int = 0                       # cached tokens moved (prompt + output - 1 per sequence)
    moved_sessions: Mapping[str, int] = field(default_factory=dict)   # session -> destination engine
    gone_sessions: tuple[str, ...] = ()      # planned contexts the source no longer held
    session_kv_tokens: int = 0               # retained-context tokens moved
    session_bytes: int = 0


def migration_items(plan: Mapping[str, int], sessions: Mapping[str, int] | None) -> list[tuple[str, int, bool]]:
    """One drain's moves in the order both transports send them: (key, destination engine,
    is_session), the in-flight requests first, then the retained session contexts."""
    return ([(rid, dest, False) for rid, dest in plan.items()]
            + [(session, dest, True) for session, dest in (sessions or {}).items()])


class EngineTransport(Protocol):
    """How the router reaches engines: submit, collect tokens, and the two drain phases."""

    def submit(self, engine: int, request: Request) -> None: ...

    def poll(self) -> list[EngineReport]: ...

    def close_admission(self, engine: int) -> list[str]:
        """Stop the engine admitting requests; return the ids it has in flight."""

    def retained_sessions(self, engine: int) -> list[str]:
        """Sessions whose context the engine holds."""

    def migrate(self, source: int, plan: Mapping[str, int], sessions: Mapping[str, int] | None = None
                ) -> MigrationResult:
        """Export each planned request (and retained session) from ``source`` and import it
        on its destination."""

    def forget(self, engine: int, sessions: list[str]) -> None:
        """Drop these sessions' retained contexts on the engine."""

    def open(self, engine: int) -> None: ...


@dataclass
class _Tracked:
    request: Request
    engine: int
    generated: int = 0
    prefilled: bool = False

    @property
    def outstanding(self) -> int:
        return outstanding_tokens_of(self.request, self.generated, self.prefilled)


class Router:
    def __init__(self, transport: EngineTransport, engines: Iterable[int]):
        self.transport = transport
        self._active: list[int] = sorted(set(engines))
        self._tracked: dict[str, _Tracked] = {}
        self._outputs: list[Output] = []
        self._home: dict[str, int] = {}       # session -> engine that holds its context
        self.migrations: list[MigrationResult] = []

    # -- routing -------------------------------------------------------------------------
    @property
    def engines(self) -> tuple[int, ...]:
        """Engines that receive new requests (ROLLOUT cells not being drained)."""
        return tuple(self._active)

    def outstanding_tokens(self, engine: int) -> int:
        return sum(t.outstanding for t in self._tracked.values() if t.engine == engine)

    def inflight(self, engine: int | None = None) -> list[str]:
        return [rid for rid, t in self._tracked.items() if engine is None or t.engine == engine]

    @property
    def sessions(self) -> dict[str, int]:
        """Session -> the engine holding its retained context, as the router booked it."""
        return dict(self._home)

    def session_home(self, session: str) -> int | None:
        return self._home.get(session)

    def choose(self, request: Request | None = None) -> int:
        """The engine holding the request's session context if it is active (affinity), else
        the active engine with the least outstanding tokens (ties: fewer requests, lower id)."""
        if not self._active:
            raise RuntimeError("router has no ROLLOUT engine to route to: every engine is drained or none was added")
        home = self._home.get(request.session) if request is not None and request.session is not None else None
        if home in self._active:
            return home
        loads = {e: self.outstanding_tokens(e) for e in self._active}
        counts = {e: 0 for e in self._active}
        for t in self._tracked.values():
            if t.engine in counts:
                counts[t.engine] += 1
        return min(self._active, key=lambda e: (loads[e], counts[e], e))

    def submit(self, request: Request) -> int:
        if request.request_id in self._tracked:
            raise ValueError(f"router: request_id {request.request_id!r} is already in flight on engine "
                             f"{self._tracked[request.request_id].engine}")
        engine = self.choose(request)
        self.transport.submit(engine, request)
        self._tracked[request.request_id] = _Tracked(request, engine)
        return engine

    def poll(self) -> list[TokenEvent]:
        """Advance/collect every engine once; returns the token events in arrival order."""
        events: list[TokenEvent] = []
        for report in self.transport.poll():
            for ev in report.events:
                t = self._tracked.get(ev.request_id)
                if t is not None:
                    t.generated = ev.index + 1
                    t.prefilled = True
                events.append(ev)
            for out in report.outputs:
                t = self._tracked.pop(out.request_id, None)
                # An output a drained engine sent before it closed: its context moved with
                # the drain, which booked the new home already.
                if t is not None and t.request.session is not None and report.engine in self._active:
                    self._home[t.request.session] = report.engine
                self._outputs.append(out)
        return events

    def pop_finished(self) -> list[Output]:
        out, self._outputs = self._outputs, []
        return out

    def unfinished(self) -> int:
        return len(self._tracked)

    def run_until_done(self) -> list[Output]:
        """Poll until every submitted request has finished (tests, benchmarks, one-off batches)."""
        while self._tracked:
            self.poll()
        return self.pop_finished()

    # -- cells joining and leaving ---------------------------------------------------------
    def add_engine(self, engine: int) -> None:
        """A cell became ROLLOUT: open its engine and route to it."""
        self.transport.open(engine)
        if engine not in self._active:
            self._active.append(engine)
            self._active.sort()

    def plan_drain(self, source: int, inflight: Iterable[str]) -> dict[str, int]:
        """Largest-first onto the least loaded remaining engine (LPT), so the moved work
        spreads evenly instead of landing on whichever engine was lightest at the start."""
        dests = [e for e in self._active if e != source]
        ids = list(inflight)
        if ids and not dests:
            raise RuntimeError(f"router: cannot drain engine {source}: {len(ids)} sequences in flight and no other "
                               f"ROLLOUT engine to take them")
        loads = {e: self.outstanding_tokens(e) for e in dests}
        plan: dict[str, int] = {}
        for rid in sorted(ids, key=lambda r: -self._cost(r)):
            dest = min(dests, key=lambda e: (loads[e], e))
            plan[rid] = dest
            loads[dest] += self._cost(rid)
        return plan

    def plan_sessions(self, source: int, sessions: Iterable[str],
                      pinned: Mapping[str, int] | None = None) -> dict[str, int]:
        """Each retained context onto the remaining engine holding the fewest (then least
        loaded): its next call will run there. A session with a call moving in the same
        drain (``pinned``: a queued call not yet prefilled) follows that call. Without
        another engine they are dropped."""
        dests = [e for e in self._active if e != source]
        if not dests:
            return {}
        pinned = pinned or {}
        held = {e: 0 for e in dests}
        for e in self._home.values():
            if e in held:
                held[e] += 1
        loads = {e: self.outstanding_tokens(e) for e in dests}
        plan: dict[str, int] = {}
        for session in sessions:
            dest = pinned.get(session)
            if dest not in held:
                dest = min(dests, key=lambda e: (held[e], loads[e], e))
            plan[session] = dest
            held[dest] += 1
        return plan

    def forget(self, sessions: Iterable[str]) -> int:
        """Drop these sessions' retained contexts (their run ended), so they take no memory
        and never migrate; returns how many the router had booked."""
        by_engine: dict[int, list[str]] = {}
        for session in sessions:
            engine = self._home.pop(session, None)
            if engine is not None:
                by_engine.setdefault(engine, []).append(session)
        for engine, dropped in by_engine.items():
            self.transport.forget(engine, dropped)
        return sum(len(v) for v in by_engine.values())

    def _cost(self, rid: str) -> int:
        t = self._tracked.get(rid)
        return t.outstanding if t is not None else 0

    def drain(self, engine: int) -> MigrationResult:
        """A ROLLOUT cell leaves (to train): stop routing to it, move every in-flight
        sequence with its KV cache to the remaining engines, where it continues, and every
        retained session context (what the engine itself reports holding) to where the
        session's next call will go."""
        if engine in self._active:
            self._active.remove(engine)
        inflight = self.transport.close_admission(engine)
        unknown = [rid for rid in inflight if rid not in self._tracked]
        if unknown:
            raise RuntimeError(f"router: engine {engine} holds requests the router never routed: {unknown[:5]}")
        plan = self.plan_drain(engine, inflight)
        calls = {self._tracked[rid].request.session: dest for rid, dest in plan.items()
                 if self._tracked[rid].request.session is not None}
        sessions = self.plan_sessions(engine, self.transport.retained_sessions(engine), calls)
        result = self.transport.migrate(engine, plan, sessions)
        for rid, dest in result.moved.items():
            self._tracked[rid].engine = dest
        for session in [s for s, e in self._home.items() if e == engine]:
            del self._home[session]         # held there no more: moved (booked below) or lost
        self._home.update(result.moved_sessions)
        self.migrations.append(result)
        return result


class InProcessEngines:
    """Engines in this process. ``poll`` steps each engine that has work once."""

    def __init__(self, engines: Mapping[int, Engine]):
        self.engines = dict(engines)

    def submit(self, engine: int, request: Request) -> None:
        self.engines[engine].submit(request)

    def poll(self) -> list[EngineReport]:
        reports = []
        for idx, eng in self.engines.items():
            events = eng.step() if eng.has_unfinished() else []
            outputs = eng.pop_finished()
            if events or outputs:
                c = eng.counters()
                reports.append(EngineReport(idx, tuple(events), tuple(outputs), c.prefill_tokens,
                                            c.cached_prompt_tokens))
        return reports

    def close_admission(self, engine: int) -> list[str]:
        eng = self.engines[engine]
        eng.close_admission()
        return eng.request_ids()

    def retained_sessions(self, engine: int) -> list[str]:
        return self.engines[engine].retained_sessions()

    def forget(self, engine: int, sessions: list[str]) -> None:
        for session in sessions:
            self.engines[engine].drop_session(session)

    def migrate(self, source: int, plan: Mapping[str, int], sessions: Mapping[str, int] | None = None
                ) -> MigrationResult:
        t0 = time.perf_counter()
        src = self.engines[source]
        # Indexed by is_session: 0 in-flight requests, 1 retained session contexts.
        held = (set(src.request_ids()), set(src.retained_sessions()))
        moved, gone, nbytes, kv_tokens, at_move = ({}, {}), ([], []), [0, 0], [0, 0], {}
        for key, dest, kind in migration_items(plan, sessions):
            if key not in held[kind]:
                gone[kind].append(key)
                continue
            # Imports copy the cache into the destination's own buffers, so no tensor is
            # shared between the two engines.
            if kind:
                state = src.export_session(key)
                self.engines[dest].import_session(state)
            else:
                state = src.kv_export(key)
                self.engines[dest].kv_import(state)
                at_move[key] = len(state.token_ids)
            moved[kind][key] = dest
            nbytes[kind] += state.nbytes
            kv_tokens[kind] += state.cached_len
        return MigrationResult(source, moved[0], tuple(gone[0]), at_move, nbytes[0], time.perf_counter() - t0,
                               kv_tokens[0], moved[1], tuple(gone[1]), kv_tokens[1], nbytes[1])

    def open(self, engine: int) -> None:
        self.engines[engine].open()

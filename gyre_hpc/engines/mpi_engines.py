"""Engines in cell ranks, driven from the controller rank over MPI.

Two halves of one protocol:

- ``serve_engine(engine, comm, controller)`` runs on the engine's rank. It decodes on its
  own (stepping whenever it has work, so engines never wait for each other) and between two
  steps handles the controller's commands. Token events and finished outputs go up to the
  controller after every step.
- ``MPIEngines(comm, ranks)`` on the controller rank is the router's ``EngineTransport``.

Message flow of a drain (controller C, source engine rank S, destination ranks D1..Dn)::

    C -> S   close                  S stops admitting and stops decoding
    S -> C   closed [request ids]   (after every event S produced before it: same tag, in order)
    C -> S   sessions               S -> C  sessions [retained session ids]
    C        plans request -> destination (least outstanding tokens), session -> destination
    C -> S   send_states [(key, Dk, is_session)]      C -> Dk  recv_states [(key, S)]
    S -> Dk  header + KV chunks (kv_transfer), point to point, never through C
    S -> C   sent {...}             Dk -> C  received {...}
    Dk       continues decoding the imported sequences (no prefill); holds the imported
             session contexts for those sessions' next calls

In-flight requests stream first, then retained session contexts, one KVState each (the
same wire form and chunked send); a session's next call is routed to its new engine only
after the drain returned, so it never arrives before its context.

Because S's events and its replies share one tag, C has seen every token S produced before
it sees S's reply; D's reply precedes its first event for an imported sequence. So the
controller's view of each request's token stream stays in order across the move.

Idle waits poll with a short sleep instead of a blocking receive: Open MPI's blocking
receive spins a core, and cells share cores with the controller on small machines.
Give this module its own communicator (``comm.Dup()``) so its tags meet no other traffic.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping

from gyre_hpc.engines.base import Engine, EngineError
from gyre_hpc.engines.kv_transfer import recv_kv_state, send_kv_state
from gyre_hpc.engines.requests import Request
from gyre_hpc.engines.router import EngineReport, MigrationResult, migration_items

CMD_TAG = 7001   # controller -> engine
UP_TAG = 7002    # engine -> controller: ("events", events, outputs, prefill, cached) or ("reply", op, payload)
NO_REPLY = ("submit", "forget")   # commands answered only when they fail

_IDLE_SLEEP_S = 0.0005
_IDLE_SLEEP_MAX_S = 0.005


def _wait_probe(comm, source: int, tag: int, timeout_s: float | None = None):
    """Wait for a message with backoff sleeps; returns its Status, or None on timeout."""
    from mpi4py import MPI

    status = MPI.Status()
    delay = _IDLE_SLEEP_S
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not comm.Iprobe(source=source, tag=tag, status=status):
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, _IDLE_SLEEP_MAX_S)
    return status


# ---- the engine rank -------------------------------------------------------------------


def serve_engine(engine: Engine, comm, controller: int = 0, chunk_bytes: int | None = None,
                 ops: Mapping[str, Callable[[object], object]] | None = None):
    """Serve ``engine`` to the controller until it says stop; returns the final counters.

    A command that fails (a bad request, weights that do not fit) is answered with an error
    the controller raises; the engine and its other sequences carry on. ``ops`` adds commands
    the rank's owner handles (e.g. ``recv_weights``: a broadcast into the engine's tensors);
    like every command they run between two decode steps, the engine's safe point.
    """
    server = _EngineServer(engine, comm, controller, chunk_bytes, ops or {})
    while not server.stopped:
        busy = server.decoding and engine.has_unfinished()
        while not server.stopped and (comm.Iprobe(source=controller, tag=CMD_TAG) or not busy):
            if not busy:
                _wait_probe(comm, controller, CMD_TAG)
            op, payload = comm.recv(source=controller, tag=CMD_TAG)
            server.handle(op, payload)
            busy = server.decoding and engine.has_unfinished()
        if server.stopped:
            break
        events = engine.step()
        outputs = engine.pop_finished()
        if events or outputs:
            # The prefill counter travels with the events of the same step, so the controller
            # can tell a first prefill (a request's token 0) from a recomputed one exactly.
            counters = engine.counters()
            server.send(("events", events, outputs, counters.prefill_tokens, counters.cached_prompt_tokens))
    server.flush()
    return engine.counters()


class _EngineServer:
    def __init__(self, engine: Engine, comm, controller: int, chunk_bytes: int | None,
                 ops: Mapping[str, Callable[[object], object]]):
        self.engine, self.comm, self.controller = engine, comm, controller
        self.ops = ops
        self.kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        self.decoding = True
        self.stopped = False
        self._sends: list = []     # upward messages not yet known to be received

    def send(self, msg) -> None:
        """Upward, never blocking: a message past MPI's eager limit (outputs carry their prompts,
        thousands of tokens in a long run) waits for the controller to receive it, while the
        controller may be waiting in its own send of a submit of that size for this rank to
        receive: each blocked on the other. Sent without blocking, the engine goes back to its
        commands; messages between two ranks keep their order either way."""
        self._sends = [r for r in self._sends if not r.Test()]
        self._sends.append(self.comm.isend(msg, dest=self.controller, tag=UP_TAG))

    def flush(self) -> None:
        """Wait until the controller has every upward message (it reads them all before the
        reply to ``stop``, the last one), so no buffer is freed while MPI still reads it."""
        from mpi4py import MPI

        MPI.Request.Waitall(self._sends)
        self._sends = []

    def reply(self, op: str, payload=None) -> None:
        self.send(("reply", op, payload))

    def handle(self, op: str, payload) -> None:
        handler = self.ops.get(op) or getattr(self, f"op_{op}", None)
        if handler is None:
            self.reply("error", f"unknown engine command {op!r}")
            return
        try:
            result = handler(payload)
        except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
            self.reply("error", f"{op}: {type(exc).__name__}: {exc}")
            return
        if op not in NO_REPLY:
            self.reply(op, result)

    def op_submit(self, request: Request):
        self.engine.submit(request)

    def op_close(self, _):
        self.engine.close_admission()
        self.decoding = False  # its sequences are about to move; they continue at the destination
        return self.engine.request_ids()

    def op_forget(self, sessions: list[str]):
        for session in sessions:
            self.engine.drop_session(session)

    def op_sessions(self, _):
        return self.engine.retained_sessions()

    def op_send_states(self, plan: list[tuple[str, int, bool]]):
        moved, gone, at_move, nbytes, kv_tokens, t0 = {}, [], {}, 0, 0, time.perf_counter()
        sessions, s_gone, s_tokens, s_bytes = {}, [], 0, 0
        inflight = set(self.engine.request_ids())
        held = set(self.engine.retained_sessions())
        for key, dest, is_session in plan:
            if is_session:
                state = self.engine.export_session(key) if key in held else None
            else:
                state = self.engine.kv_export(key) if key in inflight else None
            stats = send_kv_state(self.comm, state, dest, **self.kw)
            if state is None:
                (s_gone if is_session else gone).append(key)
            elif is_session:
                sessions[key] = dest
                s_bytes += stats.bytes
                s_tokens += state.cached_len
            else:
                moved[key], at_move[key] = dest, len(state.token_ids)
                nbytes += stats.bytes
                kv_tokens += state.cached_len
        return {"moved": moved, "gone": gone, "tokens_at_move": at_move, "bytes": nbytes, "kv_tokens": kv_tokens,
                "seconds": time.perf_counter() - t0, "outputs": self.engine.pop_finished(),
                "sessions": sessions, "gone_sessions": s_gone, "session_kv_tokens": s_tokens,
                "session_bytes": s_bytes}

    def op_recv_states(self, items: list[tuple[str, int]]):
        imported, failed, t0 = [], [], time.perf_counter()
        # Receive every planned state even if one import fails, so the source never blocks
        # on a send nobody will match.
        for rid, src in items:
            state, _ = recv_kv_state(self.comm, src)
            if state is None:
                continue
            try:
                (self.engine.import_session if state.retained else self.engine.kv_import)(state)
                imported.append(rid)
            except (ValueError, EngineError) as exc:
                failed.append(f"{rid}: {exc}")
        if failed:
            raise EngineError(f"imported {len(imported)} of {len(items)} states; failed: {'; '.join(failed)}")
        return {"imported": imported, "seconds": time.perf_counter() - t0}

    def op_open(self, _):
        self.engine.open()
        self.decoding = True

    def op_load_weights(self, payload):
        state_dict, version = payload
        self.engine.load_weights(state_dict, version)
        return self.engine.policy_version

    def op_sleep(self, level: int):
        self.engine.sleep(level)

    def op_wake(self, _):
        self.engine.wake()

    def op_stats(self, _):
        pace = getattr(self.engine, "pace_record", None)
        return {"counters": self.engine.counters(), "load": self.engine.load(),
                "sessions": self.engine.retained_sessions(), "pace": pace() if pace else None}

    def op_stop(self, _):
        self.stopped = True
        return self.engine.counters()


# ---- the controller rank ---------------------------------------------------------------


class MPIEngines:
    """The router's transport to engines served by ``serve_engine`` in other ranks."""

    def __init__(self, comm, ranks: Mapping[int, int], poll_timeout_s: float = 0.05,
                 reply_timeout_s: float = 600.0):
        self.comm = comm
        self.reply_timeout_s = reply_timeout_s   # an engine silent this long on a command fails the caller
        self.ranks = dict(ranks)              # engine id -> rank
        self._engine_of = {r: e for e, r in self.ranks.items()}
        self._pending: list[EngineReport] = []
        self._stopped: set[int] = set()       # engines whose serve loop returned (their cell trains)
        self.poll_timeout_s = poll_timeout_s

    def _rank(self, engine: int) -> int:
        if engine not in self.ranks:
            raise KeyError(f"MPIEngines: no engine {engine}; engines are {sorted(self.ranks)}")
        return self.ranks[engine]

    def _send(self, engine: int, op: str, payload=None) -> None:
        rank = self._rank(engine)
        if engine in self._stopped:
            raise EngineError(f"engine {engine} (rank {rank}) has stopped serving; once the rank is back in "
                              f"serve_engine, resume({engine}) before sending {op!r}")
        self.comm.send((op, payload), dest=rank, tag=CMD_TAG)

    def _receive_one(self, status) -> tuple | None:
        """Take one upward message; events are queued for ``poll``, replies returned as
        (engine, op, payload), where op is "error" for a failed command."""
        rank = status.Get_source()
        msg = self.comm.recv(source=rank, tag=UP_TAG)
        if msg[0] == "events":
            self._pending.append(EngineReport(self._engine_of[rank], tuple(msg[1]), tuple(msg[2]), msg[3], msg[4]))
            return None
        return (self._engine_of[rank],) + tuple(msg[1:])

    def _await_replies(self, expect: Mapping[int, str]) -> dict[int, object]:
        """Wait until every engine in ``expect`` answered its command, queueing the events
        that come first. Errors are gathered and raised only once all have answered, so no
        reply is left in flight to be mistaken for the answer to a later command."""
        from mpi4py import MPI

        got: dict[int, object] = {}
        errors: list[str] = []
        deadline = time.monotonic() + self.reply_timeout_s
        while set(expect) - set(got):
            status = _wait_probe(self.comm, MPI.ANY_SOURCE, UP_TAG, max(0.0, deadline - time.monotonic()))
            if status is None:
                silent = {e: expect[e] for e in sorted(set(expect) - set(got))}
                raise EngineError("; ".join(f"engine {e} (rank {self.ranks[e]}) did not answer {op!r} within "
                                            f"{self.reply_timeout_s:g} s" for e, op in silent.items()))
            r = self._receive_one(status)
            if r is None:
                continue
            engine, op, payload = r
            if engine in expect and engine not in got and op in (expect[engine], "error"):
                got[engine] = payload
                if op == "error":
                    errors.append(f"engine {engine} (rank {self.ranks[engine]}) {expect[engine]}: {payload}")
            elif op == "error":       # a command without a reply (submit) failed earlier
                errors.append(f"engine {engine} (rank {self.ranks[engine]}): {payload}")
            else:
                errors.append(f"engine {engine} sent an unexpected reply {op!r}")
        if errors:
            raise EngineError("; ".join(errors))
        return got

    def call_many(self, commands: Mapping[int, tuple[str, object]]) -> dict[int, object]:
        """One command with a reply to each of several engines, all sent before any reply is
        awaited (they may meet in one collective, e.g. ``recv_weights``)."""
        for engine, (op, payload) in commands.items():
            self._send(engine, op, payload)
        return self._await_replies({engine: op for engine, (op, _) in commands.items()})

    def call(self, engine: int, op: str, payload=None):
        """One command with a reply (stats, load_weights, sleep, wake, open, stop)."""
        self._send(engine, op, payload)
        result = self._await_replies({engine: op})[engine]
        if op == "stop":
            self._stopped.add(engine)
        return result

    # -- EngineTransport ---------------------------------------------------------------
    def submit(self, engine: int, request: Request) -> None:
        self._send(engine, "submit", request)

    def poll(self) -> list[EngineReport]:
        """Everything the engines sent since the last poll; waits up to ``poll_timeout_s``
        for the first message so a polling loop does not spin."""
        from mpi4py import MPI

        replies = []
        if not self._pending:
            status = _wait_probe(self.comm, MPI.ANY_SOURCE, UP_TAG, self.poll_timeout_s)
            if status is not None:
                replies.append(self._receive_one(status))
        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=UP_TAG, status=status):
            replies.append(self._receive_one(status))
        out, self._pending = self._pending, []
        errors = [f"engine {r[0]} (rank {self.ranks[r[0]]}): {r[2] if r[1] == 'error' else f'unexpected reply {r[1]!r}'}"
                  for r in replies if r is not None]
        if errors:
            self._pending = out   # nothing is lost: the events are returned by the next poll
            raise EngineError("; ".join(errors))
        return out

    def close_admission(self, engine: int) -> list[str]:
        return list(self.call(engine, "close"))

    def retained_sessions(self, engine: int) -> list[str]:
        return list(self.call(engine, "sessions"))

    def forget(self, engine: int, sessions: list[str]) -> None:
        # A stopped engine was drained first (its contexts moved), and a run may end while
        # the fleet pauses engines: nothing to tell it, and it must not fail that run.
        if engine not in self._stopped:
            self._send(engine, "forget", list(sessions))

    def migrate(self, source: int, plan: Mapping[str, int], sessions: Mapping[str, int] | None = None
                ) -> MigrationResult:
        items = migration_items(plan, sessions)
        by_dest: dict[int, list[tuple[str, int]]] = {}
        for key, dest, _ in items:
            by_dest.setdefault(dest, []).append((key, self._rank(source)))
        # The source streams states in plan order; each destination receives its share in
        # that same order, so no receive waits on a send queued behind it.
        self._send(source, "send_states", [(key, self._rank(dest), is_s) for key, dest, is_s in items])
        for dest, items in by_dest.items():
            self._send(dest, "recv_states", items)
        expect = {dest: "recv_states" for dest in by_dest}
        expect[source] = "send_states"
        sent = self._await_replies(expect)[source]
        if sent["outputs"]:
            self._pending.append(EngineReport(source, (), tuple(sent["outputs"])))
        # The source names destinations by rank; the router books requests by engine id.
        moved = {rid: self._engine_of[rank] for rid, rank in sent["moved"].items()}
        moved_sessions = {s: self._engine_of[rank] for s, rank in sent["sessions"].items()}
        return MigrationResult(source, moved, tuple(sent["gone"]), sent["tokens_at_move"],
                               sent["bytes"], sent["seconds"], sent["kv_tokens"], moved_sessions,
                               tuple(sent["gone_sessions"]), sent["session_kv_tokens"], sent["session_bytes"])

    def resume(self, engine: int) -> None:
        """Note that a stopped engine's rank is back in ``serve_engine`` (its cell left TRAIN)."""
        self._rank(engine)
        self._stopped.discard(engine)

    def open(self, engine: int) -> None:
        self.call(engine, "open")

    def stats(self, engine: int) -> dict:
        return self.call(engine, "stats")

    def stop(self) -> dict[int, object]:
        """Stop every serving engine's loop; returns each one's final counters."""
        serving = [e for e in self.ranks if e not in self._stopped]
        for engine in serving:
            self._send(engine, "stop")
        result = self._await_replies({engine: "stop" for engine in serving})
        self._stopped.update(serving)
        return result

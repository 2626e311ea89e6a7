"""The one engine interface every rollout engine implements (torch reference, vLLM adapter).

Why a step-driven interface rather than a blocking ``generate``: the cell process (or a test)
owns the loop, so between two decode iterations it can admit requests, export sequences for
migration, load new weights or go to sleep, exactly the points where continuous batching
lets sequences join and leave. ``generate`` is a convenience on top for one-off calls.

Lifecycle: open (admits requests) -> ``drain()`` (stops admitting, hands back every in-flight
sequence as a ``KVState``) -> ``sleep()`` (frees memory) -> ``wake()`` -> ``open()``.
``tests/engines/conformance.py`` is the behaviour every engine must show.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Mapping

import torch

from gyre_hpc.engines.kv_state import KVLayout, KVState
from gyre_hpc.engines.requests import EngineCounters, Output, Request, TokenEvent


class EngineError(RuntimeError):
    """An engine cannot do what was asked in its current state; the message says why."""


@dataclass(frozen=True)
class EngineLoad:
    """What the router and the scheduler read off an engine between steps."""

    queued: int = 0              # submitted, not yet prefilled
    running: int = 0             # prefilled, decoding
    kv_tokens: int = 0           # tokens held in KV caches
    outstanding_tokens: int = 0  # work left: queued prompts + every sequence's remaining budget


def outstanding_tokens_of(request: Request, generated: int, prefilled: bool) -> int:
    """The router's unit of load: tokens still to run through the model for this request.

    One definition for engines and router alike, so "least outstanding tokens" means the
    same on both sides of the MPI boundary.
    """
    remaining = request.params.max_new_tokens - generated
    return remaining + (0 if prefilled else request.prompt_len)


class EngineBookkeeping:
    """The state accessors every concrete engine keeps the same way.

    Why a mixin and not code in ``Engine``: the interface stays abstract (an engine may hold
    these elsewhere), while TorchEngine and VLLMEngine share one copy of the bookkeeping:
    ``_layout``, ``_version``, ``_c`` (counter values), ``_asleep``, ``_needs_weights`` and
    ``_finished`` (outputs not yet popped) and ``_accepting`` (open to new requests).
    """

    name: str
    _layout: KVLayout
    _version: int
    _c: dict[str, int]
    _asleep: int
    _needs_weights: bool
    _finished: dict[str, Output]
    _accepting: bool

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def policy_version(self) -> int:
        return self._version

    def counters(self) -> EngineCounters:
        return EngineCounters(**self._c)

    def close_admission(self) -> None:
        self._accepting = False

    def open(self) -> None:
        self._check_usable("open")
        self._accepting = True

    def pop_output(self, request_id: str) -> Output | None:
        return self._finished.pop(request_id, None)

    def pop_finished(self) -> list[Output]:
        out = list(self._finished.values())
        self._finished.clear()
        return out

    def adopt_weights(self, version: int) -> None:
        """The model's own tensors were overwritten in place (a broadcast received into them,
        between two decode steps); tokens from now on are of ``version``."""
        self._check_usable("adopt_weights")
        self._version = version

    def _check_usable(self, action: str) -> None:
        if self._asleep:
            raise EngineError(f"engine {self.name} is asleep (level {self._asleep}): wake() before {action}")
        if self._needs_weights:
            raise EngineError(f"engine {self.name} dropped its weights in sleep(level=2): load_weights() before {action}")


class Engine(ABC):
    name: str

    # -- requests ------------------------------------------------------------------------
    @abstractmethod
    def submit(self, request: Request) -> None:
        """Queue a request; it is prefilled and joins the running batch at the next ``step``.
        Raises EngineError while draining or asleep, ValueError for a duplicate id."""

    @abstractmethod
    def step(self) -> list[TokenEvent]:
        """One iteration: admit queued requests (prefill, first token) and advance every
        running sequence by one token. Returns one event per sequence that produced a token."""

    @abstractmethod
    def pop_output(self, request_id: str) -> Output | None:
        """The finished output of ``request_id`` (removed from the engine), or None if unfinished."""

    @abstractmethod
    def pop_finished(self) -> list[Output]:
        """Every finished output not yet popped, in finishing order."""

    @abstractmethod
    def request_ids(self) -> list[str]:
        """Requests in flight (queued or running), in admission order."""

    @abstractmethod
    def load(self) -> EngineLoad: ...

    # -- migration -----------------------------------------------------------------------
    @abstractmethod
    def kv_export(self, request_id: str) -> KVState:
        """Remove an in-flight request and return everything needed to continue it elsewhere."""

    @abstractmethod
    def kv_import(self, state: KVState) -> None:
        """Continue a sequence exported by an engine with the same ``kv_layout`` without
        recomputing its cache (a never-prefilled state is simply queued)."""

    @property
    @abstractmethod
    def kv_layout(self) -> KVLayout: ...

    # -- retained sessions (agent contexts kept between calls) -----------------------------
    # The default engine retains none: nothing to move when it is released. An engine with
    # its own prefix cache that cannot hand it out (vLLM) keeps this default; its cache
    # serves the calls routed back to it, and a released engine's cache is simply lost.
    def retained_sessions(self) -> list[str]:
        """Sessions whose context this engine holds, least recently used first."""
        return []

    def export_session(self, session: str) -> KVState:
        """Remove a session's retained context and return it (``KVState.retained``) for
        ``import_session`` on another engine with the same ``kv_layout``."""
        raise KeyError(f"engine {self.name} retains no session contexts (asked for {session!r})")

    def import_session(self, state: KVState) -> None:
        """Hold a retained context exported by another engine, as if this engine had computed it."""
        raise EngineError(f"engine {self.name} retains no session contexts; it cannot import {state.request_id!r}")

    def drop_session(self, session: str) -> bool:
        """Forget a session's retained context (its run ended); True if one was held."""
        return False

    def drain(self) -> list[KVState]:
        """Stop admitting and export every in-flight sequence (the rollout -> train flip)."""
        self.close_admission()
        return [self.kv_export(rid) for rid in self.request_ids()]

    @abstractmethod
    def close_admission(self) -> None: ...

    @abstractmethod
    def open(self) -> None:
        """Admit requests again (the train -> rollout flip, after ``wake`` and ``load_weights``)."""

    # -- weights and memory --------------------------------------------------------------
    @abstractmethod
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place; sequences in flight continue under the new ones and
        their outputs report the oldest version that produced any of their tokens."""

    @property
    @abstractmethod
    def policy_version(self) -> int: ...

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Free memory while the cell trains. Level 1 frees KV memory and keeps weights;
        level 2 also drops the weights (``load_weights`` is then required after ``wake``).
        Refused while sequences are in flight: drain first."""

    @abstractmethod
    def wake(self) -> None: ...

    @abstractmethod
    def counters(self) -> EngineCounters: ...

    # -- convenience ---------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return bool(self.request_ids())

    def generate(self, request: Request) -> Output:
        """Submit and step until this request finishes; other requests advance too and keep
        their outputs for ``pop_output``/``pop_finished``."""
        self.submit(request)
        while True:
            self.step()
            out = self.pop_output(request.request_id)
            if out is not None:
                return out
            if request.request_id not in self.request_ids():
                raise EngineError(f"engine {self.name}: request {request.request_id} left the engine unfinished "
                                  f"(exported or drained while generate() waited)")

"""A session's token context: which tokens a new request's prompt is, given the calls before it.

Why: an outside scaffold sends text (OpenAI messages), but the trees and the trainer need the
exact token ids the engine sampled. Re-rendering the conversation and re-tokenizing it would
turn the model's own tokens into the tokenizer's canonical ones (re-tokenization drift), and the
next prompt would no longer extend the previous call. So each call of a session is kept as
(messages it was given, reply it returned, prompt ids, sampled ids), and a new request is planned
against them, first match wins:

- ``retry``: the request is a call's messages again: the same prompt, the same ids.
- ``extend``: the request is some call's messages + that call's reply + new turns. The prompt is
  that call's prompt + its exact sampled ids + the ids of only the new text (the end of the
  assistant turn the model did not write, and the new turns), however the template would
  re-render the reply (tool calls as the template's JSON). Of the last call: the common case;
  of an earlier one (the scaffold dropped a middle turn): a branch from that call's end, still
  with exact tokens.
- ``render``: anything else (the scaffold edited a reply, compressed, or the template is not
  prefix-stable): the whole request rendered fresh, based on the call whose ids share the
  longest prefix with it (``base``/``shared``, as ``trees.calls`` records a call).
  When the request holds a rebuilt reply (a call's messages, then an assistant turn other than
  the one it returned) whose ids leave that call's prompt + sampled ids, that is drift, counted.

All pure: the renderer (``chat_render.ChatRenderer``) does no I/O.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gyre_hpc.harness.chat_render import ChatRenderer
from gyre_hpc.trees.calls import common_prefix

# The message fields that reach a template; anything else a client echoes back (``refusal``,
# ``annotations``, ``audio``: None) does not change a prompt and must not break a match.
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")


def normalize_message(message: dict) -> dict:
    """The message as the template sees it: its known fields without None, content None as ""."""
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"a message must be an object with a 'role'; got {message!r:.80}")
    out = {k: message[k] for k in MESSAGE_FIELDS if message.get(k) is not None}
    out["content"] = message.get("content") or ""
    if isinstance(out["content"], list):   # OpenAI content parts: only text reaches a text model
        out["content"] = "".join(p.get("text", "") for p in out["content"] if isinstance(p, dict))
    return out


def _key(message: dict) -> str:
    return json.dumps(message, sort_keys=True)


@dataclass(frozen=True)
class SessionCall:
    """One call of a session as the planner needs it (``messages`` and ``reply`` normalized)."""

    messages: tuple[dict, ...]
    reply: dict
    prompt: tuple[int, ...]
    output: tuple[int, ...]

    @property
    def seq(self) -> tuple[int, ...]:
        return self.prompt + self.output

    @cached_property
    def keys(self) -> tuple[str, ...]:
        """Its messages as comparable strings, computed once: planning compares every call's."""
        return tuple(_key(m) for m in self.messages)

    @cached_property
    def reply_keys(self) -> tuple[str, ...]:
        return self.keys + (_key(self.reply),)


@dataclass(frozen=True)
class PromptPlan:
    """A request's prompt and where it comes from: the first ``shared`` ids are call ``base``'s
    prompt + output (-1: none), and ``kind`` is ``extend``, ``retry`` or ``render``."""

    prompt: tuple[int, ...]
    base: int
    shared: int
    kind: str
    drift: int = 0           # rebuilt replies whose ids differ from the sampled ones (0 or 1)


def _matches(request: tuple[str, ...], call_keys: tuple[str, ...]) -> bool:
    return len(request) >= len(call_keys) and request[:len(call_keys)] == call_keys


def _new_turn_ids(renderer: ChatRenderer, call: SessionCall, request: list[dict], render_kw: dict) -> list[int] | None:
    """Ids of what follows ``call``'s sampled ids in ``request``'s rendering, or None when the
    template does not render the request as ``call``'s prompt text + the sampled text + more."""
    prompt_text = renderer.render(call.messages, add_generation_prompt=True, **render_kw)
    turn_text = renderer.render(list(call.messages) + [call.reply], add_generation_prompt=False, **render_kw)
    full_text = renderer.render(request, add_generation_prompt=True, **render_kw)
    sampled = renderer.decode(call.output)
    if not (turn_text.startswith(prompt_text) and full_text.startswith(turn_text)):
        return None
    reply_text = turn_text[len(prompt_text):]
    if reply_text.startswith(sampled):
        closure = reply_text[len(sampled):]
    else:
        # The template writes the reply otherwise than the model did (tool calls as its own
        # JSON): the reply is the one returned, so its ids are the sampled ones, and what
        # closes the turn is what the template puts after its end-of-turn token.
        eos = renderer.tokenizer.eos_token
        end = reply_text.rfind(eos)
        if end < 0:
            return None
        closure = ("" if sampled.endswith(eos) else eos) + reply_text[end + len(eos):]
    return renderer.encode(closure + full_text[len(turn_text):])


def plan_prompt(renderer: ChatRenderer, calls: Sequence[SessionCall], messages: Sequence[dict], *,
                tools: Sequence[dict] | None = None, tool_choice=None) -> PromptPlan:
    """The prompt of a request with ``messages`` after the session's ``calls`` (see the module)."""
    request = [normalize_message(m) for m in messages]
    if not request:
        raise ValueError("messages is empty; a chat request needs at least one message")
    keys = tuple(_key(m) for m in request)
    render_kw = {"tools": tools, "tool_choice": tool_choice}
    for k in range(len(calls) - 1, -1, -1):
        if keys == calls[k].keys:
            return PromptPlan(calls[k].prompt, k, len(calls[k].prompt), "retry")
    # extend: the longest call messages + reply the request starts with, the newest of equals
    best = None
    for k in range(len(calls) - 1, -1, -1):
        call = calls[k]
        call_keys = call.reply_keys
        if len(keys) > len(call_keys) and _matches(keys, call_keys) and (best is None or len(call_keys) > best[1]):
            best = (k, len(call_keys))
    if best is not None:
        call = calls[best[0]]
        new = _new_turn_ids(renderer, call, request, render_kw)
        if new is not None:
            return PromptPlan(call.seq + tuple(new), best[0], len(call.seq), "extend")
    prompt = tuple(renderer.encode(renderer.render(request, add_generation_prompt=True, **render_kw)))
    ids = np.asarray(prompt, dtype=np.int64)
    base, shared = -1, 0
    for k in range(len(calls) - 1, -1, -1):
        n = common_prefix(np.asarray(calls[k].seq, dtype=np.int64), ids)
        if n > shared:
            base, shared = k, n
    return PromptPlan(prompt, base, shared, "render", _drift(calls, keys, request, prompt))


def _drift(calls: Sequence[SessionCall], keys: tuple[str, ...], request: list[dict], prompt: tuple[int, ...]) -> int:
    """1 when the request rebuilds a call's reply (that call's messages, then an assistant turn)
    and the rebuilt ids do not carry that call's prompt + sampled ids."""
    for call in reversed(calls):
        n = len(call.messages)
        if len(request) > n and request[n]["role"] == "assistant" and _matches(keys, call.keys):
            return int(prompt[:len(call.seq)] != call.seq)
    return 0

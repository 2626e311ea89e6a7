"""The tool-call format: what a model output means as an action (THE one module of it).

A call is the standard ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5's
and Hermes' format), e.g. ``<tool_call>{"name": "write", "arguments": {"path": "notes.txt",
"content": "hello"}}</tool_call>``. With the embedded tokenizer ``<tool_call>`` and
``</tool_call>`` are single special tokens and ``</tool_call>`` is a stop token; with a
checkpoint's own tokenizer they are whatever that vocabulary makes of them. Whitespace around
the JSON is allowed; ``arguments`` may be an object or a JSON string of one (both are seen
from real models).

Every output is an action. An output that is not a well-formed call (no ``<tool_call>``
first, invalid JSON, an unknown tool, a missing ``</tool_call>`` because the budget ran out,
a missing or unknown argument) is the **default action**: its text (specials dropped) is
appended to the task's answer file. So the reward is always defined and a model that has not
learnt the syntax yet still changes the workspace, which is what lets a tiny model make
partial progress.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from gyre_hpc.models.tokenizer import TOOL_CALL_END, TOOL_CALL_START, ChatTokenizer, embedded_tokenizer

# tool -> (argument names in order, how many of them are required)
TOOLS: dict[str, tuple[tuple[str, ...], int]] = {
    "read": (("path",), 1),
    "write": (("path", "content"), 2),
    "list": (("path",), 0),
    "exec": (("command",), 1),
    "test": (("scope",), 0),     # scope: run only the tests named scope or scope/...
    "delegate": (("task",), 1),
    "finish": (("message",), 0),
}


@dataclass(frozen=True)
class Action:
    tool: str                 # a TOOLS name, or "answer" for the default action
    args: tuple[bytes, ...]   # argument values in TOOLS order (UTF-8)

    def text(self, i: int = 0) -> str:
        return self.args[i].decode("utf-8", errors="replace") if i < len(self.args) else ""


def tool_call_json(tool: str, *args: str | bytes) -> str:
    """The JSON body of a call to ``tool`` with positional ``args`` (in TOOLS order)."""
    if tool not in TOOLS:
        raise ValueError(f"tool {tool!r} is unknown: valid tools are {', '.join(TOOLS)}")
    names, required = TOOLS[tool]
    if not required <= len(args) <= len(names):
        raise ValueError(f"tool {tool!r} takes {required}..{len(names)} arguments ({', '.join(names)}), got {len(args)}")
    values = [a.decode("utf-8", errors="replace") if isinstance(a, bytes) else a for a in args]
    return json.dumps({"name": tool, "arguments": dict(zip(names, values))}, ensure_ascii=False)


def marker_ids(tok: ChatTokenizer, marker: str) -> list[int]:
    """``<tool_call>`` or ``</tool_call>`` as ids: one special token where the vocabulary has it."""
    i = tok.token_id(marker)
    return [i] if i is not None else tok.encode(marker)


def format_action(tool: str, *args: str | bytes, tokenizer: ChatTokenizer | None = None) -> list[int]:
    """The token ids of a well-formed call: what a trained model should emit (scripts, tests)."""
    tok = tokenizer or embedded_tokenizer()
    return marker_ids(tok, TOOL_CALL_START) + tok.encode(tool_call_json(tool, *args)) + marker_ids(tok, TOOL_CALL_END)


def _loads(text: str):
    """The JSON value of ``text``, or None for anything Python's json refuses: besides syntax
    errors (JSONDecodeError) that is RecursionError past ~1000 nested levels and ValueError
    for an integer of more than 4300 digits; a model writes all three (gyre-hpc bench fuzz)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _parse_call(text: str) -> Action | None:
    text = text.lstrip()
    if not text.startswith(TOOL_CALL_START) or TOOL_CALL_END not in text:
        return None
    call = _loads(text[len(TOOL_CALL_START):text.index(TOOL_CALL_END)].strip())
    # A name that is a list or an object is unhashable: `in TOOLS` would raise TypeError.
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or call["name"] not in TOOLS:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _loads(arguments)
    if not isinstance(arguments, dict) or not all(isinstance(v, str) for v in arguments.values()):
        return None
    names, required = TOOLS[call["name"]]
    if set(arguments) - set(names):
        return None
    given = [n for n in names if n in arguments]
    if given != list(names[:len(given)]) or len(given) < required:
        return None
    try:
        return Action(call["name"], tuple(arguments[n].encode("utf-8") for n in given))
    except UnicodeEncodeError:
        return None   # a lone surrogate (JSON "\ud800") is not text: not a well-formed call


def parse_action(output: Sequence[int], tokenizer: ChatTokenizer | None = None) -> Action:
    tok = tokenizer or embedded_tokenizer()
    ids = [int(t) for t in output]
    action = _parse_call(tok.decode(ids, skip_special_tokens=False))
    if action is not None:
        return action
    return Action("answer", (tok.decode(ids, skip_special_tokens=True).encode("utf-8"),))


def split_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """An output's text (specials as written) as the OpenAI endpoint replies it: the text
    outside well-formed ``<tool_call>`` blocks, and each block's (name, arguments as a JSON
    string). Any name is a call here (the scaffold declared its tools); a block that is not a
    JSON object with a string name, or that the budget cut before ``</tool_call>``, stays text."""
    content, calls, at = [], [], 0
    while (start := text.find(TOOL_CALL_START, at)) >= 0:
        end = text.find(TOOL_CALL_END, start)
        if end < 0:
            break
        call = _loads(text[start + len(TOOL_CALL_START):end].strip())
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            content.append(text[at:end + len(TOOL_CALL_END)])
        else:
            content.append(text[at:start])
            calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        at = end + len(TOOL_CALL_END)
    content.append(text[at:])
    return "".join(content).strip() if calls else "".join(content), calls

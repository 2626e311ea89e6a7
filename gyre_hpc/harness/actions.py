"""The tool-call syntax: what a model output means as an action.

A call is ``CALL <letter> <arg bytes> [SEP <arg bytes>] END`` (CALL/SEP/END are single
special tokens, see tokenizer.py), e.g. ``<call>wnotes.txt<sep>hello<end>``. Why this shape:
a tiny byte-level model learns it as "special, one letter, bytes, special"; there is no
quoting or escaping to get wrong, and END doubles as the engine's stop token.

Every output is an action. An output that is not a well-formed call (no CALL first, an
unknown letter, a missing END because the budget ran out, the wrong argument count) is
the **default action**: its bytes (specials dropped) are appended to the task's answer
file. So the reward is always defined and a model that has not learnt the syntax yet
still changes the workspace, which is what lets a tiny model make partial progress.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gyre_hpc.harness.tokenizer import CALL, END, SEP, encode, split_bytes

# letter -> (tool name, allowed argument counts)
TOOLS: dict[str, tuple[str, tuple[int, ...]]] = {
    "r": ("read", (1,)),
    "w": ("write", (2,)),
    "l": ("list", (0, 1)),
    "x": ("exec", (1,)),
    "t": ("test", (0,)),
    "d": ("delegate", (1,)),
    "f": ("finish", (0, 1)),
}
TOOL_LETTER = {name: letter for letter, (name, _) in TOOLS.items()}


@dataclass(frozen=True)
class Action:
    tool: str                 # a TOOLS name, or "answer" for the default action
    args: tuple[bytes, ...]   # raw argument bytes

    def text(self, i: int = 0) -> str:
        return self.args[i].decode("utf-8", errors="replace") if i < len(self.args) else ""


def parse_action(output: Sequence[int]) -> Action:
    ids = [int(t) for t in output]
    fallback = Action("answer", (split_bytes(ids),))
    if len(ids) < 3 or ids[0] != CALL or END not in ids:
        return fallback
    end = ids.index(END)
    letter = ids[1]
    if not 0 <= letter < 128 or chr(letter) not in TOOLS:
        return fallback
    name, arities = TOOLS[chr(letter)]
    body = ids[2:end]
    if any(t > 255 and t != SEP for t in body):
        return fallback
    args: list[bytes] = []
    if body:
        start = 0
        for k, t in enumerate(body + [SEP]):
            if t == SEP:
                args.append(bytes(body[start:k]))
                start = k + 1
    if len(args) not in arities:
        return fallback
    return Action(name, tuple(args))


def format_action(tool: str, *args: str | bytes) -> list[int]:
    """The token ids of a well-formed call: what a trained model should emit (scripts, tests)."""
    ids = [CALL, ord(TOOL_LETTER[tool])]
    for k, a in enumerate(args):
        if k:
            ids.append(SEP)
        ids.extend(a if isinstance(a, bytes) else encode(a))
    ids.append(END)
    return ids

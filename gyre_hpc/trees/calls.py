"""A run's model calls held as increments: each prompt by reference to an earlier call.

Why: a call's prompt is nearly always an earlier call's prompt + output + new text, so holding
every prompt whole costs calls x context (quadratic in a long run), and so does any code that
reads every prompt whole (the tree builder fed full prompts grew with exponent 2.5). A
``CallIncrement`` says "the first ``shared`` tokens of call ``base``'s prompt + output, then
``new``": exactly the journal's call record (``harness.journal``), so the journal, the harness
and the tree builder (``builder.build_tree``) share one representation, and a run holds its
unique tokens once. ``CallLog`` is the list of them; indexing it gives an ordinary
``ModelCall`` whose prompt is materialised then (O(prompt), held only as long as the caller
keeps it), for code that wants whole prompts (the reference loss, tests).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from gyre_hpc.trees.model import ModelCall, check_call_record


@dataclass(frozen=True)
class CallIncrement:
    """One model call: its prompt is the first ``shared`` tokens of call ``base``'s prompt +
    output (``base`` -1: nothing shared), followed by ``new``."""

    base: int
    shared: int
    new: np.ndarray
    output: np.ndarray
    logprobs: np.ndarray
    role: str = "main"
    agent: str = "main"
    policy_version: int = 0

    def __post_init__(self) -> None:
        check_call_record(self, "new")
        if self.base < 0 and self.shared != 0 or self.shared < 0:
            raise ValueError(f"CallIncrement: shares {self.shared} tokens with call {self.base}")

    @property
    def prompt_len(self) -> int:
        return self.shared + int(self.new.size)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class CallLog(Sequence[ModelCall]):
    """A run's calls as increments (see the module docstring); ``log[k]`` is call k whole."""

    def __init__(self, increments: Sequence[CallIncrement] = ()) -> None:
        self.increments: list[CallIncrement] = []
        self._seq_len: list[int] = []       # prompt + output tokens of each call
        self._last_of_agent: dict[str, int] = {}
        self._counts: Counter[tuple[str, str]] = Counter()     # (agent, role) -> calls
        for inc in increments:
            self.append(inc)

    def append(self, inc: CallIncrement) -> None:
        """Add the next call; its base must be an earlier call and ``shared`` within its tokens."""
        k = len(self.increments)
        if not -1 <= inc.base < k:
            raise ValueError(f"call {k}: base call {inc.base} is not an earlier call (of {k})")
        if inc.base >= 0 and inc.shared > self._seq_len[inc.base]:
            raise ValueError(f"call {k}: shares {inc.shared} tokens with call {inc.base} of "
                             f"{self._seq_len[inc.base]} tokens")
        self.increments.append(inc)
        self._seq_len.append(inc.prompt_len + int(inc.output.size))
        self._last_of_agent[inc.agent] = k
        self._counts[inc.agent, inc.role] += 1

    def count(self, agent: str, role: str) -> int:
        """Calls so far of ``agent`` in ``role`` (kept as calls arrive: O(1))."""
        return self._counts[agent, role]

    def seq_len(self, k: int) -> int:
        """Tokens of call k's prompt + output."""
        return self._seq_len[k]

    def __len__(self) -> int:
        return len(self.increments)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        inc = self.increments[k]
        return ModelCall(self.prompt(k), inc.output, inc.logprobs, role=inc.role, agent=inc.agent,
                         policy_version=inc.policy_version)

    def __iter__(self) -> Iterator[ModelCall]:
        return (self[k] for k in range(len(self)))

    def prompt(self, k: int) -> np.ndarray:
        """Call k's prompt, materialised from the increments: O(its length + the chain's depth)."""
        k = range(len(self))[k]
        inc = self.increments[k]
        pieces, need, j = [inc.new], inc.shared, inc.base
        while need > 0:
            # the first ``need`` tokens of call j's prompt + output
            base = self.increments[j]
            if need > base.prompt_len:
                pieces.append(base.output[:need - base.prompt_len])
                need = base.prompt_len
            if need > base.shared:
                pieces.append(base.new[:need - base.shared])
                need = base.shared
            j = base.base
        return np.concatenate(pieces[::-1]) if len(pieces) > 1 else pieces[0].copy()

    def seq(self, k: int) -> np.ndarray:
        """Call k's prompt followed by its output."""
        return np.concatenate([self.prompt(k), self.increments[k].output])

    @property
    def unique_tokens(self) -> int:
        """Tokens the log holds (new prompt tokens and outputs): what a run costs to keep."""
        return sum(int(i.new.size + i.output.size) for i in self.increments)

    @property
    def policy_versions(self) -> list[int]:
        return [i.policy_version for i in self.increments]

    def increment_for(self, call: ModelCall, window: int = 8) -> CallIncrement:
        """``call`` (which arrives whole: a synthetic journal, a test) as the next increment,
        based on whichever of its agent's previous call and the ``window`` calls before it
        shares the longest prefix with its prompt. The harness knows each prompt's origin and
        never searches."""
        k = len(self)
        candidates = dict.fromkeys([self._last_of_agent.get(call.agent, -1), *range(k - 1, k - 1 - window, -1)])
        base, shared = -1, 0
        for c in sorted((c for c in candidates if c >= 0), key=lambda c: -self._seq_len[c]):
            if self._seq_len[c] <= shared:
                break  # a shorter sequence cannot share more
            n = common_prefix(self.seq(c)[:call.prompt.size], call.prompt)
            if n > shared:
                base, shared = c, n
        return CallIncrement(base, shared, call.prompt[shared:], call.output, call.logprobs, call.role, call.agent,
                             call.policy_version)

    @classmethod
    def of(cls, calls: Sequence[ModelCall]) -> "CallLog":
        """Whole calls as increments (``increment_for`` each)."""
        log = cls()
        for call in calls:
            log.append(log.increment_for(call))
        return log

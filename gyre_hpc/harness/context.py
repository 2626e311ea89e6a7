"""Token contexts held by reference: a branch shares its prefix, it never copies it.

An agent's context only grows (``context + output + tool text``) until it branches (a retry
rewinds to its anchor, a compression starts over from the intro). A context here is a chain
of append-only segments: ``(segment, length)``, where a segment's tokens follow a prefix of
its parent context. Extending the newest context of a segment appends in place (amortised
doubling); extending an older one (a branch: the segment already goes on differently) starts
a new segment whose parent is that context, so a retry costs its new tokens, whatever the
length of the prefix it keeps. The memory held is the unique tokens of the live contexts.

``array`` materialises the tokens (a copy, O(length)): what a model client is sent. ``tail(k)``
gives the tokens from position k on without touching the prefix: the new tokens a journal
record stores.

Provenance (``origin``): ``as_call(k)`` marks a context as call k's prompt + output (or, on a
prompt, as call k's prompt); ``extend`` keeps the mark and ``prefix`` shortens it. A call's
prompt then names its base call and the tokens it shares with it (``CallIncrement``) without
comparing a token, so a journal record and the tree builder's insertion cost the new tokens,
however long the context (``trees.calls``).
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


class _Segment:
    __slots__ = ("parent", "start", "data", "used")

    def __init__(self, parent: "TokenContext | None", tokens: np.ndarray):
        self.parent = parent                        # the context this segment's tokens follow
        self.start = len(parent) if parent is not None else 0
        self.data = np.empty(max(16, 2 * tokens.size), dtype=np.int32)
        self.data[:tokens.size] = tokens
        self.used = tokens.size

    def append(self, tokens: np.ndarray) -> None:
        need = self.used + tokens.size
        if need > self.data.size:
            grown = np.empty(max(need, 2 * self.data.size), dtype=np.int32)
            grown[:self.used] = self.data[:self.used]
            self.data = grown     # nothing views the old array: materialised tokens are copies
        self.data[self.used:need] = tokens
        self.used = need


def _ids(tokens: Iterable[int] | np.ndarray) -> np.ndarray:
    return np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int32).reshape(-1)


class TokenContext:
    """An immutable token sequence held as a chain of shared, append-only segments."""

    __slots__ = ("_seg", "_length", "origin")

    def __init__(self, seg: _Segment, length: int, origin: tuple[int, int] | None = None):
        self._seg, self._length = seg, length
        self.origin = origin        # (call, shared): its first ``shared`` tokens are that call's

    @classmethod
    def of(cls, tokens: Iterable[int] | np.ndarray) -> "TokenContext":
        ids = _ids(tokens)
        return cls(_Segment(None, ids), ids.size)

    def __len__(self) -> int:
        return self._length

    def extend(self, tokens: Iterable[int] | np.ndarray) -> "TokenContext":
        """This context followed by ``tokens``: in place when this is its segment's newest context."""
        ids = _ids(tokens)
        seg = self._seg
        if seg.start + seg.used == self._length:
            seg.append(ids)
            return TokenContext(seg, self._length + ids.size, self.origin)
        return TokenContext(_Segment(self, ids), self._length + ids.size, self.origin)  # a branch

    def prefix(self, n: int) -> "TokenContext":
        """The first ``n`` tokens, sharing the segments (extending it later branches)."""
        if not 0 <= n <= self._length:
            raise ValueError(f"TokenContext.prefix({n}) outside 0..{self._length}")
        origin = None if self.origin is None else (self.origin[0], min(self.origin[1], n))
        ctx = self
        while n < ctx._seg.start:       # the prefix ends inside an earlier segment
            ctx = ctx._seg.parent
        return TokenContext(ctx._seg, n, origin)

    def as_call(self, call: int) -> "TokenContext":
        """The same tokens, marked as call ``call``'s (its prompt, or its prompt + output)."""
        return TokenContext(self._seg, self._length, (call, self._length))

    def tail(self, start: int) -> np.ndarray:
        """The tokens from position ``start`` to the end (a copy): O(their number + segments)."""
        if not 0 <= start <= self._length:
            raise ValueError(f"TokenContext.tail({start}) outside 0..{self._length}")
        pieces, seg, end = [], self._seg, self._length
        while end > start:
            lo = max(start, seg.start)
            pieces.append(seg.data[lo - seg.start:end - seg.start])
            end = lo
            if end > start:
                end = min(end, len(seg.parent))
                seg = seg.parent._seg
        out = np.concatenate(pieces[::-1]) if pieces else np.zeros(0, dtype=np.int32)
        return out if len(pieces) > 1 else out.copy()

    @property
    def array(self) -> np.ndarray:
        """All the tokens as one int32 array (a copy)."""
        return self.tail(0)

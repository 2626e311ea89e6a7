"""Token contexts that share memory: each call's prompt is a view, never a full copy.

An agent's context only grows (``context + output + tool text``) until it branches
(compression, retry, a sub-agent's own intro). Holding each call's prompt as its own array
costs calls x context: quadratic in a long run. Here a context is ``(buffer, length)``: an
append-only int32 buffer that grows by doubling, and a prompt is the read-only view
``buffer[:length]``. Extending the newest context of a buffer appends in place; extending
an older one (a branch) copies its prefix into a fresh buffer, so no view ever changes.
Buffers left behind by a doubling stay alive only through the views made before it, so the
memory held is at most about twice the unique tokens.

The journal loader rebuilds calls through the same class, so a loaded journal shares its
contexts exactly as the live harness did.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np


class _Buffer:
    __slots__ = ("data", "used")

    def __init__(self, capacity: int):
        self.data = np.empty(max(capacity, 16), dtype=np.int32)
        self.used = 0

    def append(self, tokens: np.ndarray) -> None:
        need = self.used + tokens.size
        if need > self.data.size:
            grown = np.empty(max(need, 2 * self.data.size), dtype=np.int32)
            grown[:self.used] = self.data[:self.used]
            self.data = grown  # earlier views keep the old array alive; it is never written again
        self.data[self.used:need] = tokens
        self.used = need


class TokenContext:
    """An immutable token sequence backed by a shared, append-only buffer."""

    __slots__ = ("_buffer", "_length", "_view")

    def __init__(self, buffer: _Buffer, length: int):
        self._buffer, self._length = buffer, length
        view = buffer.data[:length]
        view.flags.writeable = False
        self._view = view

    @classmethod
    def of(cls, tokens: Iterable[int] | np.ndarray) -> "TokenContext":
        tokens = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int32).reshape(-1)
        buffer = _Buffer(2 * tokens.size)
        buffer.append(tokens)
        return cls(buffer, tokens.size)

    def __len__(self) -> int:
        return self._length

    @property
    def array(self) -> np.ndarray:
        """The tokens as a read-only int32 view (no copy)."""
        return self._view

    def extend(self, tokens: Iterable[int] | np.ndarray) -> "TokenContext":
        """This context followed by ``tokens``: in place when this is the buffer's newest context."""
        tokens = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int32).reshape(-1)
        if self._buffer.used == self._length:
            self._buffer.append(tokens)
            return TokenContext(self._buffer, self._length + tokens.size)
        # A branch: the buffer already continues differently past our end.
        buffer = _Buffer(2 * (self._length + tokens.size))
        buffer.append(self._view)
        buffer.append(tokens)
        return TokenContext(buffer, self._length + tokens.size)

    def prefix(self, n: int) -> "TokenContext":
        """The first ``n`` tokens, sharing the buffer (extending it later branches)."""
        if not 0 <= n <= self._length:
            raise ValueError(f"TokenContext.prefix({n}) outside 0..{self._length}")
        return TokenContext(self._buffer, n)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D arrays."""
    n = min(a.size, b.size)
    if np.array_equal(a[:n], b[:n]):
        return n
    return int(np.flatnonzero(a[:n] != b[:n])[0])

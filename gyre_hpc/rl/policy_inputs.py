"""The figures of ``ClusterState`` the runtime has to measure itself (contract 2).

Small pure pieces so they test without processes: the wall-clock timer of sustained demand
over capacity, and the ranking of unfinished runs by expected remaining time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping


@dataclass
class DemandClock:
    """How long queued plus in-flight requests have continuously exceeded what the serving
    engines hold at the target occupancy. The caller feeds it AFTER dispatching what it could,
    so a call routed in the same pass counts as in flight, not as queued demand; any moment
    the demand fits resets it (the hysteresis interval is the policy's)."""

    per_engine: int
    _since: float | None = None

    def update(self, now: float, queued: int, inflight: int, engines: int) -> float:
        over = queued + inflight > engines * self.per_engine or (queued > 0 and engines == 0)
        if not over:
            self._since = None
            return 0.0
        if self._since is None:
            self._since = now
        return now - self._since


def tail_runs(started: Mapping[str, float], finished: set[str] | Mapping[str, object],
              fraction: float = 0.25) -> set[str]:
    """The unfinished runs expected to finish last: the ``fraction`` (at least one) open longest.

    Why elapsed time: run durations are heavy-tailed (tool latency, long agent loops), and for
    such a law the expected remaining time grows with the time already spent, so the oldest
    open runs are the best estimate of the ones that set the step time.
    """
    open_runs = sorted((t0, rid) for rid, t0 in started.items() if rid not in finished)
    if not open_runs:
        return set()
    k = max(1, math.ceil(len(open_runs) * fraction))
    return {rid for _, rid in open_runs[:k]}


def run_of_request(request_id: str) -> str:
    """Request ids are ``<run id>-<n>`` (``RouterDriver.generate`` tags them with the run)."""
    return request_id.rsplit("-", 1)[0]

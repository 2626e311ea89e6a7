"""The figures of ``ClusterState`` the runtime has to measure itself (contract 2).

Small pure pieces so they test without processes: the wall-clock timer of sustained demand
over capacity, and the run a request belongs to (the tail estimator is
``gyre_hpc.sched.tail``, shared with the simulator).
"""
from __future__ import annotations

from dataclasses import dataclass


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


def run_of_request(request_id: str) -> str:
    """Request ids are ``<run id>-<n>`` (``RoutedCalls.generate`` tags them with the run)."""
    return request_id.rsplit("-", 1)[0]

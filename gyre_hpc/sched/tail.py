"""The tail estimator: which unfinished runs are expected to finish last.

One function for the runtime and the simulator, fed only what a controller can observe
while a run is open (when it started, how many model calls it has made). Neither may rank
by a run's true remaining work: the runtime cannot know it, and a simulator that reads its
own sampled future flatters every policy that protects the tail.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Hashable, Mapping


# The runtime's share of open runs it protects as the tail; the simulator's workload sets
# its own (``Workload.tail_fraction``).
DEFAULT_FRACTION = 0.25


@dataclass(frozen=True)
class RunProgress:
    """What a controller sees of an open run."""
    started: float            # when it took its place (math.inf: not started yet)
    calls: int = 0            # model calls it has completed so far


def tail_runs(open_runs: Mapping[Hashable, RunProgress], fraction: float) -> set:
    """The ``fraction`` (at least one) of ``open_runs`` expected to finish last.

    Elapsed time first: run durations are heavy-tailed (tool latency, long agent loops),
    and for such a law the expected remaining time grows with the time already spent, so
    the oldest open runs are the best estimate of those that set the step time. Among runs
    open equally long (a batch starts together), fewer calls so far means a slower pace
    (longer outputs, slower tools), which the rest of the run keeps. Runs not started yet
    (``started = inf``) rank last: they have shown nothing.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"tail fraction={fraction}: must be in (0, 1]")
    if not open_runs:
        return set()
    k = max(1, math.ceil(len(open_runs) * fraction))
    return set(heapq.nsmallest(k, open_runs, key=lambda rid: (open_runs[rid].started, open_runs[rid].calls, str(rid))))

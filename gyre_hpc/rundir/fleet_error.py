"""The error a fleet died of, from the rank that raised it to the head.

Why: the head relaunches a failed fleet from its last checkpoint, which is right for a lost
node or a killed step, and wrong for an error the fleet meets the same way every time (a
checkpoint it cannot read, a setting only the ranks can check): that cost four launches and
ended with exit codes, the cause only in a fleet log. The rank that raises writes what it
raised here (``guard_world``); the head compares a failed launch's report with the one before
and stops once a launch fails with the same error from the same checkpoint
(``same_failure``): the next launch would start from the same state and meet it again.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass

from gyre_hpc.rundir.layout import RunDir

MESSAGE_CHARS = 2000   # a message longer than this is cut (a dumped tensor, a long path list)


@dataclass(frozen=True)
class FleetError:
    kind: str       # the exception's type name
    message: str
    rank: int
    time: float

    def __str__(self) -> str:
        return f"{self.kind}: {self.message} (rank {self.rank})"


def report(run: RunDir, exc: BaseException, rank: int) -> None:
    """On a rank dying of ``exc``: record it unless a rank of this launch already did (the
    first error is the cause; the others are usually its echo: created exclusively, and the
    head clears it before each launch). Best effort: the rank is dying, and its stderr has the
    traceback."""
    data = json.dumps({"kind": type(exc).__name__, "message": str(exc)[:MESSAGE_CHARS], "rank": rank,
                       "time": time.time()})
    try:
        fd = os.open(run.fleet_error, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        with contextlib.suppress(OSError):
            f.write(data)


def clear(run: RunDir) -> None:
    """Before a launch: what an earlier launch died of is not this one's."""
    run.fleet_error.unlink(missing_ok=True)


def read(run: RunDir, since: float = 0.0) -> FleetError | None:
    """The report a fleet wrote after ``since`` (unix time), or None."""
    try:
        data = json.loads(run.fleet_error.read_text())
        err = FleetError(str(data["kind"]), str(data["message"]), int(data["rank"]), float(data["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return err if err.time >= since else None


def same_failure(before: tuple[FleetError | None, int | None], now: tuple[FleetError | None, int | None]) -> bool:
    """Whether two failed launches, each ``(its error, the checkpoint step it started from)``,
    failed alike: the same error from the same checkpoint. A launch with no report (a killed
    step, a segfault, a lost node) is never alike: that is what relaunching is for."""
    (err_a, step_a), (err_b, step_b) = before, now
    if err_a is None or err_b is None:
        return False
    return (err_a.kind, err_a.message, step_a) == (err_b.kind, err_b.message, step_b)

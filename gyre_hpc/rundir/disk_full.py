"""A full disk, from the fleet's side to the head's.

When a write finds the run directory's file system full, the fleet cannot say so in the run
directory: its log, ``metrics.h5`` and every other file there are on the same full disk. So
the head sets ``RunDir.space_reserve`` aside at each start, and the rank whose write failed
measures the space, frees the reserve and writes ``RunDir.disk_full`` in its place (the file,
the space, the rank) before ending the fleet with ``contract.EXIT_DISK_FULL``. The head reads
the report, does not relaunch (a relaunch would fill the same disk again) and stops naming
the file and the space; the next start, once space is freed, clears it and resumes.
"""
from __future__ import annotations

import json
import time

from gyre_hpc import fsio
from gyre_hpc.rundir.layout import RunDir

RESERVE_BYTES = 64 * 1024


def set_aside(run: RunDir) -> None:
    """Clear an earlier report and write the reserve; ``DiskFullError`` if even that fails
    (the disk is still full: nothing should start)."""
    run.disk_full.unlink(missing_ok=True)
    fsio.write_bytes(run.space_reserve, bytes(RESERVE_BYTES))


def describe(run: RunDir, exc: BaseException) -> str:
    """The message: ``DiskFullError``'s (file and space), or the run directory's space when the
    failing write did not say which file it was."""
    if isinstance(exc, fsio.DiskFullError):
        return str(exc)
    for e in (exc, exc.__cause__, exc.__context__):
        if isinstance(e, fsio.DiskFullError):
            return str(e)
    where = getattr(exc, "filename", None) or f"a file under {run.root}"
    return f"No space left on device writing {where} ({fsio.space_report(run.root)}): {type(exc).__name__}: {exc}"


def report(run: RunDir, exc: BaseException, rank: int) -> str:
    """On the rank whose write failed: free the reserve, write the report; the message."""
    message = describe(run, exc)   # the space as the failure left it, before the reserve is freed
    run.space_reserve.unlink(missing_ok=True)
    try:
        fsio.write_text(run.disk_full, json.dumps({"message": message, "rank": rank, "time": time.time()}))
    except OSError:
        pass    # the exit code still says it; the message is on the rank's stderr
    return message


def read(run: RunDir, since: float = 0.0) -> dict | None:
    """The report a fleet wrote after ``since`` (unix time), or None."""
    try:
        data = json.loads(run.disk_full.read_text())
    except (OSError, ValueError):
        return None
    return data if float(data.get("time", 0.0)) >= since else None

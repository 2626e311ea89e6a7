"""The contract between a head (``jobs/``) and its fleet (``cells/``), written once.

The head does not import the fleet (that would start MPI in the head), so what both sides
must agree on lives here, below both: the exit codes a fleet ends with and what the head
does with each. The control files the head drops for its fleet are ``RunDir`` paths
(``exit_request``, ``head_alive``).
"""
from __future__ import annotations

# Every step done: the head finishes the run.
EXIT_DONE = 0
# Checkpointed on request (checkpoint-and-exit, or the head's lease ran out) and exited: the
# head stops (or requeues); a relaunch resumes from that checkpoint. 75 is sysexits' EX_TEMPFAIL.
EXIT_CHECKPOINTED = 75
# A write found the run directory's disk (or quota) full: the fleet wrote ``RunDir.disk_full``
# and stopped; a relaunch cannot help until space is freed, so the head stops too. sysexits' EX_IOERR.
EXIT_DISK_FULL = 74

"""Tie a local fleet's life to its head: ``python -I fleet_guard.py FD -- CMD...``.

Why: a head killed with SIGKILL (an OOM kill, ``kill -9``, a lost login shell) runs no
handler, and ``mpiexec`` with its ranks would go on writing the run directory under the next
head. ``PR_SET_PDEATHSIG`` alone does not carry: it reaches only the direct child (mpiexec,
not its ranks), is cleared by fork, and fires when the *thread* that forked exits. So the
guard is the fleet's session leader; it holds the read end of a pipe whose only write end
is the head's, and EOF on it means the head is gone, however it died. Then the guard
SIGTERMs its whole process group (mpiexec forwards it to the ranks), waits ``GRACE_S``, and
SIGKILLs what is left. Otherwise it is transparent: it exits with the command's status, and
a SIGTERM to the group (the launcher's kill) reaches the command while the guard waits.
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

GRACE_S = 5.0


PR_SET_PDEATHSIG = 1


def _child_setup() -> None:
    import ctypes

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:   # the guard died before prctl took effect
        os._exit(137)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -I fleet_guard.py FD -- CMD...", file=sys.stderr)
        return 2
    head_fd, command = int(argv[0]), argv[2:]
    # The group's SIGTERM is for the command; the guard stays to report its status.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # An ignored signal stays ignored across exec: the command gets SIGTERM back (the guard is
    # single-threaded, so preexec_fn is safe here). And the command dies with the guard: a
    # SIGKILL of the guard itself (the process a supervisor or an operator sees) must not leave
    # mpiexec running beside the next launch; PDEATHSIG is safe here because the guard's only
    # thread forked it and lives as long as the guard.
    child = subprocess.Popen(command, preexec_fn=_child_setup)
    sel = selectors.DefaultSelector()
    sel.register(head_fd, selectors.EVENT_READ)
    while True:
        rc = child.poll()
        if rc is not None:
            return 128 - rc if rc < 0 else rc
        if sel.select(timeout=0.5) and not os.read(head_fd, 64):
            break   # EOF: the head is gone
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)   # the guard too: nothing of this fleet stays
    return 137


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

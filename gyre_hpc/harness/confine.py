"""Confinement for model-written commands.

Commands run through ``sandbox_exec.py`` (namespaces, a minimal read-only root, an
unprivileged uid, rlimits; see that module for the sequence and why each step is there),
with a scrubbed environment and a wall-clock timeout that SIGKILLs the jail's PID 1 (so the
whole PID namespace) and the launcher's process group; output is capped. The file tools,
which run in the harness process itself, guard their own door: see ``tools`` and ``beneath``.
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness import beneath

SANDBOX_EXEC = Path(__file__).with_name("sandbox_exec.py")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# Root mode drops to a uid in this range, one per workspace, so concurrent runs each get
# their own RLIMIT_NPROC budget (it is counted per real uid, machine-wide).
SANDBOX_UID_BASE = 200_000
SANDBOX_UID_SPAN = 100_000
HOST_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# The jail's spec (the command inside) is one argv string, and Linux refuses a string of
# MAX_ARG_STRLEN (32 pages, 4 KiB ones here) or more with E2BIG. The spec is ASCII JSON,
# where a non-ASCII character costs six bytes (\uXXXX): ~22K accented characters suffice.
MAX_SPEC_BYTES = 32 * 4096 - 1
QUOTA_POLL_S = 0.1   # how often a running command's workspace is measured against Limits.workspace_mb


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 10
    address_space_mb: int = 1024
    file_size_mb: int = 8
    # What the workspace may hold (allocated blocks of all its files). RLIMIT_FSIZE is per
    # file; this bounds their sum, so a command cannot fill the run directory's disk: checked
    # every ``QUOTA_POLL_S`` while a command runs (past it, the jail is killed) and before each
    # file tool write. A command can overshoot by what it writes in one poll.
    workspace_mb: int = 256
    nproc: int = 64
    nofile: int = 256
    output_bytes: int = 4096       # what the caller gets back
    drain_bytes: int = 1 << 20     # read (and drop) this much more before stopping a flood
    # What of the host a jailed command sees, read-only (symlinks such as /bin -> usr/bin
    # are recreated as links). Nothing else is there: no /run, /var, /home, /tmp.
    host_paths: tuple[str, ...] = HOST_PATHS
    # Run model-written commands even where no namespace jail can be made (``plain``: rlimits,
    # a new session and a scrubbed env only: a setsid leftover can outlive the wall clock and
    # the command sees the host's files). Off by default: refused with ConfinementError.
    allow_unconfined: bool = False

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "address_space_mb", "file_size_mb", "workspace_mb", "nproc", "nofile",
                     "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)} must be > 0")
        for p in self.host_paths:
            norm = os.path.normpath(p)
            # The jail's own /tmp (the workspace), /proc and /dev are built fresh; exposing the
            # host's there would put its sockets and sibling workspaces back in view.
            if not os.path.isabs(p) or norm == "/" or any(norm == d or norm.startswith(d + "/")
                                                           for d in ("/tmp", "/proc", "/dev")):
                raise ValueError(f"Limits.host_paths has {p!r}: host paths are absolute and outside /, /tmp, "
                                 f"/proc and /dev (the jail builds those itself)")


class ConfinementError(RuntimeError):
    """No jail can be made here and unconfined commands were not allowed; names the capability."""


class CommandTooLong(ValueError):
    """The command does not fit the one argument it travels in; says how long it is and may be."""


UNCONFINED_REFUSED = (
    "model-written commands need a jail (PID and mount namespaces), and this process can make none: it "
    "is not root (uid {uid}) and the kernel refuses it a user namespace (unshare(CLONE_NEWUSER) failed; "
    "see sysctl kernel.unprivileged_userns_clone, user.max_user_namespaces, or an AppArmor userns "
    "restriction). Run as root, enable unprivileged user namespaces, or set rollout.allow_unconfined: "
    "true to run them with rlimits only (a setsid leftover can then outlive its wall clock)")


def check_confinement(allow_unconfined: bool = False) -> str:
    """The isolation mode commands will run in; raises ConfinementError for ``plain`` unless allowed."""
    mode = isolation_mode()
    if mode == "plain" and not allow_unconfined:
        raise ConfinementError(UNCONFINED_REFUSED.format(uid=os.geteuid()))
    return mode


@dataclass(frozen=True)
class CommandResult:
    returncode: int | None      # None when the command was killed (timeout or output flood)
    output: bytes               # stdout+stderr interleaved, at most Limits.output_bytes
    timed_out: bool
    truncated: bool
    wall_s: float
    over_quota_mb: float | None = None   # left the workspace holding this much, past Limits.workspace_mb
    quota_mb: int | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """How a tool result shows the command's fate to the model."""
        text = self.output.decode("utf-8", errors="replace")
        if self.truncated:
            text += "\n[output truncated]"
        if self.timed_out:
            return text + "\n[killed: wall-clock timeout]"
        if self.over_quota_mb is not None:
            fate = "killed" if self.returncode is None else f"exit {self.returncode}"
            return text + (f"\n[{fate}: the workspace holds {self.over_quota_mb:.1f} MiB, past its quota of "
                           f"{self.quota_mb} MiB; delete files to go on]")
        return text + ("" if self.returncode is None else f"\n[exit {self.returncode}]")


@functools.lru_cache(maxsize=1)
def isolation_mode() -> str:
    """``root`` (jail + uid drop) as root; ``userns`` (jail in a user namespace) when the
    kernel lets this user make one; else ``plain`` (rlimits and a scrubbed env only)."""
    if os.geteuid() == 0:
        return "root"
    probe = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         "import ctypes, sys; sys.exit(ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0)"],
        env={"PATH": SANDBOX_PATH}, capture_output=True)
    return "userns" if probe.returncode == 0 else "plain"


def sandbox_uid(workspace: Path) -> int:
    return SANDBOX_UID_BASE + zlib.crc32(str(Path(workspace).resolve()).encode()) % SANDBOX_UID_SPAN


def sandbox_env(home: str) -> dict[str, str]:
    """The whole environment a command sees; nothing is inherited from the harness."""
    return {"PATH": SANDBOX_PATH, "HOME": home, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


def run_confined(command: str, workspace: str | Path, limits: Limits = Limits(),
                 stdin: bytes | None = None) -> CommandResult:
    """Run ``sh -c command`` confined to ``workspace``; always returns for whatever the command
    does (ConfinementError where no jail can be made and ``limits`` does not allow running
    without one: never silently weaker; CommandTooLong before anything runs for a command
    past ``MAX_SPEC_BYTES`` as JSON)."""
    ws = Path(workspace).resolve()
    if not ws.is_dir():
        raise FileNotFoundError(f"workspace {ws} is not a directory")
    mode = check_confinement(limits.allow_unconfined)
    home = str(ws) if mode == "plain" else "/tmp/workspace"
    pid_read, pid_write = os.pipe()
    spec = {"mode": mode, "workspace": str(ws), "command": command, "env": sandbox_env(home),
            "uid": sandbox_uid(ws), "host_paths": list(limits.host_paths), "pid_fd": pid_write,
            "limits": {k: getattr(limits, k) for k in ("cpu_s", "address_space_mb", "file_size_mb", "nproc", "nofile")}}
    arg = json.dumps(spec)
    if len(arg) > MAX_SPEC_BYTES:
        os.close(pid_read)
        os.close(pid_write)
        raise CommandTooLong(f"the command is {len(command.encode('utf-8', 'surrogatepass'))} bytes, {len(arg)} as the "
                             f"jail's JSON argument, past the kernel's limit of {MAX_SPEC_BYTES + 1} for one argument: "
                             f"write it to a file and run that")
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(SANDBOX_EXEC), arg],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            env={"PATH": SANDBOX_PATH}, cwd=str(ws), close_fds=True, pass_fds=(pid_write,))
    except BaseException:
        os.close(pid_read)
        raise
    finally:
        os.close(pid_write)
    try:
        # PID 1 reports before any of the command runs; on a loaded machine that can take
        # longer than a short wall clock, and without its pid a setsid leftover could survive.
        jail = _JailInit.read(pid_read, start + max(limits.wall_s, 30.0)) if mode != "plain" else _JailInit(None)
    finally:
        os.close(pid_read)
    try:
        if stdin is not None:
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        output, truncated, killed = _collect(proc, jail, start + limits.wall_s, limits, ws)
    finally:
        jail.kill()   # whatever happened above, nothing of the jail outlives this call
        jail.close()
    timed_out = killed == "timeout"
    rc = None if killed else proc.returncode
    # Measured once more at the end: a command that writes past the quota and exits within
    # one poll was never caught running, and what it left must still be reported.
    held = workspace_bytes(ws)
    over = held / (1 << 20) if killed == "quota" or (not timed_out and held > limits.workspace_mb * (1 << 20)) else None
    return CommandResult(rc, output, timed_out, truncated, time.monotonic() - start, over,
                         limits.workspace_mb if over is not None else None)


def workspace_bytes(workspace: str | Path) -> int:
    """Bytes the workspace's entries occupy on disk (allocated blocks: a sparse file counts
    what it really holds); walked by fd (``beneath.walk``), so a hostile tree costs bounded time."""
    fd = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    total = os.fstat(fd).st_blocks * 512
    try:
        for _, st, _, _ in beneath.walk(fd):
            total += st.st_blocks * 512
    except (RuntimeError, OSError):
        pass    # a tree changing under the walk: what was counted so far
    finally:
        os.close(fd)
    return total


@dataclass
class _JailInit:
    """A pidfd on the jail's PID 1. SIGKILL to it ends the whole PID namespace, including
    processes that left the process group (``setsid``, a double fork, a new session), which
    a ``killpg`` misses. A pidfd, not a pid: it cannot hit a recycled pid."""

    pidfd: int | None

    @classmethod
    def read(cls, fd: int, deadline: float) -> "_JailInit":
        data = b""
        with selectors.DefaultSelector() as sel:   # not select(): the harness may hold > 1024 fds
            sel.register(fd, selectors.EVENT_READ)
            while not data.endswith(b"\n"):
                if not sel.select(timeout=max(deadline - time.monotonic(), 0)):
                    break
                chunk = os.read(fd, 32)
                if not chunk:
                    break    # the jail failed before PID 1 existed; its output says why
                data += chunk
        if not data.strip():
            return cls(None)
        try:
            # PID 1 cannot be reaped (and its pid reused) before its parent outside, which
            # waits for it, so opening the pidfd now names the right process.
            return cls(os.pidfd_open(int(data)))
        except (ProcessLookupError, ValueError):
            return cls(None)

    def kill(self) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, ValueError, OSError):
        pass


def _kill_group(proc: subprocess.Popen, jail: "_JailInit") -> None:
    jail.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _collect(proc: subprocess.Popen, jail: "_JailInit", deadline: float, limits: Limits,
             workspace: Path) -> tuple[bytes, bool, str | None]:
    """Read output until exit, the deadline, a flood or a workspace past its quota; kill the
    group on the latter three."""
    kept = bytearray()
    seen = 0
    killed: str | None = None
    quota = limits.workspace_mb * (1 << 20)
    next_measure = time.monotonic() + QUOTA_POLL_S
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    fd = proc.stdout.fileno()
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = "timeout"
                _kill_group(proc, jail)
                break
            if time.monotonic() >= next_measure:
                next_measure = time.monotonic() + QUOTA_POLL_S
                if workspace_bytes(workspace) > quota:
                    killed = "quota"
                    _kill_group(proc, jail)
                    break
            if not sel.select(timeout=min(remaining, QUOTA_POLL_S)):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += len(chunk)
            if len(kept) < limits.output_bytes:
                kept += chunk[: limits.output_bytes - len(kept)]
            if seen > limits.output_bytes + limits.drain_bytes:
                killed = "flood"
                _kill_group(proc, jail)
                break
    finally:
        sel.close()
    while killed is None:
        # EOF is not exit: a command may close its output and keep running (and writing).
        try:
            proc.wait(timeout=max(min(deadline - time.monotonic(), QUOTA_POLL_S), 0))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                killed = "timeout"
            elif workspace_bytes(workspace) > quota:
                killed = "quota"
            if killed:
                _kill_group(proc, jail)
    proc.wait()
    # The group may outlive its leader (plain mode: a background child); nothing of it stays.
    _kill_group(proc, jail)
    proc.stdout.close()
    return bytes(kept), seen > limits.output_bytes, killed

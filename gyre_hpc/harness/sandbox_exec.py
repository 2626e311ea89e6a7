"""The confined side of ``confine.run_confined``: set up the jail, then exec ``/bin/sh -c``.

Run as ``python -I -S sandbox_exec.py '<json>'``, never imported by the harness. Why a
separate process instead of ``preexec_fn``: the harness drives many runs on threads and
``preexec_fn`` is unsafe after fork in a threaded parent; this script starts single-
threaded and stdlib-only, so every step below is safe.

Mode ``root`` (the harness runs as root, as on this machine and in many containers):
  1. new mount, PID and network namespaces (no network; a fresh PID 1 whose death kills
     every process the command started, even ones that ``setsid`` out of the group);
  2. a private tmpfs over /tmp holding ``/tmp/workspace``, a bind mount of the workspace;
  3. every other mount remounted read-only, so writes outside the workspace fail with
     EROFS whatever the path (``..``, symlinks, /tmp, /dev/shm, /sys/fs/cgroup);
  4. the workspace chowned to an unprivileged uid; groups cleared; setgid/setuid to it,
     so the command cannot undo step 3 and RLIMIT_NPROC (counted per real uid) bounds a
     fork bomb; the uid is derived from the workspace path so concurrent runs do not
     share one NPROC budget;
  5. rlimits (CPU, AS, FSIZE, NPROC, NOFILE), cwd ``/tmp/workspace``, the scrubbed env.
Mode ``userns`` (not root, unprivileged user namespaces allowed, as on most clusters):
  the same jail built inside a new user namespace that maps only the caller's own uid to
  itself: the setup runs with the namespace's capabilities, and ``execve`` as a non-zero
  uid drops them, so the command cannot remount anything; RLIMIT_NPROC counts the
  caller's own processes (set it above what the user already runs).
Mode ``plain`` (no namespaces at all): rlimits, new session, scrubbed env only; see
docs/harness.md for what that does not stop.
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import sys

# Run as a script with -I -S: the package is not importable, its stdlib-only sibling is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import beneath  # noqa: E402

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
_KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}
JAIL_WORKSPACE = "/tmp/workspace"

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _unshare(flags):
    if _libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare: {os.strerror(err)}")


def _mounts():
    """(mount point, per-mount option flags) from mountinfo, octal escapes decoded."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = 0
            for opt in fields[5].split(","):
                flags |= _KEEP_FLAGS.get(opt, 0)
            out.append((point, flags))
    return out


def _enter_user_namespace():
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _build_jail(workspace):
    _unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    ws_fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.mkdir(JAIL_WORKSPACE)
    _mount(f"/proc/self/fd/{ws_fd}", JAIL_WORKSPACE, None, MS_BIND)
    os.close(ws_fd)
    for point, flags in _mounts():
        if point == JAIL_WORKSPACE or point.startswith("/proc"):
            continue
        try:
            _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            # A mount hidden under a later one cannot be reached by path anyway.
            pass


def _chown_tree(root, uid, gid):
    """Iterative and by directory fd (``beneath.walk``): a model-built 3,000-deep chain is
    longer than PATH_MAX by name and deeper than Python's recursion limit."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.chown(fd, uid, gid)
        for _, _, parent_fd, name in beneath.walk(fd):
            os.chown(name, uid, gid, dir_fd=parent_fd, follow_symlinks=False)
    finally:
        os.close(fd)


def _set_limits(limits):
    mb = 1024 * 1024
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["address_space_mb"] * mb),
                        ("RLIMIT_FSIZE", limits["file_size_mb"] * mb), ("RLIMIT_NPROC", limits["nproc"]),
                        ("RLIMIT_NOFILE", limits["nofile"]), ("RLIMIT_CORE", 0)):
        resource.setrlimit(getattr(resource, name), (value, value))


def main() -> None:
    spec = json.loads(sys.argv[1])
    env = spec["env"]
    mode = spec["mode"]
    if mode in ("root", "userns"):
        if mode == "userns":
            _enter_user_namespace()
        _build_jail(spec["workspace"])
        pid = os.fork()  # the child is PID 1 of the new PID namespace
        if pid:
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError:
            pass  # the PID namespace still bounds the process tree; /proc then shows host pids
        os.chdir(JAIL_WORKSPACE)
        _set_limits(spec["limits"])
        if mode == "root":
            uid = gid = spec["uid"]
            _chown_tree(JAIL_WORKSPACE, uid, gid)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
    else:
        os.chdir(spec["workspace"])
        _set_limits(spec["limits"])
    os.umask(0o022)
    os.execve("/bin/sh", ["sh", "-c", spec["command"]], env)


if __name__ == "__main__":
    main()

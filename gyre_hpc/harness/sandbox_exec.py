"""The confined side of ``confine.run_confined``: set up the jail, then exec ``/bin/sh -c``.

Run as ``python -I -S sandbox_exec.py '<json>'``, never imported by the harness (tests import
its pure parts). Why a separate process instead of ``preexec_fn``: the harness drives many
runs on threads and ``preexec_fn`` is unsafe after fork in a threaded parent; this script
starts single-threaded and stdlib-only, so every step below is safe.

Mode ``root`` (the harness runs as root, as on this machine and in many containers):
  1. new mount, PID, network, IPC and UTS namespaces: no network (abstract unix sockets
     live in the network namespace, so none of the host's is reachable), no SysV segment
     or POSIX queue shared with the host or outliving the jail;
  2. this process forks; the child is PID 1 of the new PID namespace and writes nothing
     but its pid to the harness (``pid_fd``): at the wall clock the harness SIGKILLs that
     pid, and the kernel kills every process of the namespace with it, whatever
     ``setsid``/double fork/new session they did. PID 1 also gets a parent-death signal;
  3. PID 1 builds a new root on a tmpfs holding only what a command needs: read-only
     binds of ``host_paths`` (/usr, /etc, ...; the symlinks /bin, /lib... as symlinks), a
     minimal /dev (null, zero, full, random, urandom, tty), a fresh /proc, and
     ``/tmp/workspace``, a bind of the workspace. ``pivot_root`` into it and detach the
     old root: /run (the munge socket), /var, /home, /tmp and every sibling run's
     workspace and journals are simply not there;
  4. every mount but the workspace and /proc remounted read-only; a mount that cannot be
     made read-only fails the jail closed (exit 125 before the command runs);
  5. the workspace chowned to an unprivileged uid; groups cleared; setgid/setuid to it,
     so the command cannot undo step 4 and RLIMIT_NPROC (counted per real uid) bounds a
     fork bomb; the uid is derived from the workspace path so concurrent runs do not
     share one NPROC budget;
  6. rlimits (CPU, AS, FSIZE, NPROC, NOFILE), cwd ``/tmp/workspace``, the scrubbed env.
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
import platform
import resource
import sys

if __package__:
    from gyre_hpc.harness import beneath
else:  # run as a script with -I -S: the package is not importable, its stdlib-only sibling is
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import beneath  # noqa: E402

CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUTS = 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
_KEEP_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
               "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME,
               "nosymfollow": 256}  # locked in a user namespace: a remount must keep each of these
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
JAIL_WORKSPACE = "/tmp/workspace"
NEW_ROOT = "/tmp"           # the tmpfs the new root is built on, before pivot_root
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
EXIT_JAIL_FAILED = 125      # the jail could not be built as specified: the command never ran

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def _unshare(flags):
    _check(_libc.unshare(flags), "unshare")


def _unescape(field: bytes) -> str:
    r"""A mountinfo path: the kernel writes space, tab, newline and backslash as ``\ooo``
    octal and every other byte as it is (UTF-8 stays raw bytes); decoded to a str the way
    ``os.fsdecode`` decodes any path, so non-ASCII names round-trip exactly."""
    out = bytearray()
    i = 0
    while i < len(field):
        code = field[i + 1:i + 4]
        if field[i] == 0x5C and len(code) == 3 and all(0x30 <= c <= 0x37 for c in code):
            out.append(int(field[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return os.fsdecode(bytes(out))


def parse_mountinfo(data: bytes) -> list[tuple[int, int, str, int]]:
    """(mount id, parent id, mount point, per-mount flags to keep on remount) per mountinfo line."""
    out = []
    for line in data.splitlines():
        fields = line.split(b" ")
        if len(fields) < 6:
            continue
        flags = 0
        for opt in fields[5].decode().split(","):
            flags |= _KEEP_FLAGS.get(opt, 0)
        out.append((int(fields[0]), int(fields[1]), _unescape(fields[4]), flags))
    return out


def mounts_beneath(mounts: list[tuple[int, int, str, int]], top: str) -> list[tuple[str, int]]:
    """The mounts of the tree rooted at the last mount on ``top`` (the one seen there), with
    their points relative to it: what the root will hold after ``pivot_root``. Mounts on the
    same path but under the old root (hidden by ``top``) go with the old root."""
    root_id = next(mid for mid, _, point, _ in reversed(mounts) if point == top)
    keep, rel = {root_id}, []
    for mid, parent, point, flags in mounts:
        if mid == root_id or parent in keep:
            keep.add(mid)
            rel.append(("/" + point[len(top):].lstrip("/"), flags))
    return rel


def _enter_user_namespace():
    uid, gid = os.getuid(), os.getgid()
    _unshare(CLONE_NEWUSER)
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")


def _bind_host_paths(host_paths):
    """O_PATH fds of the host paths to expose (opened before the tmpfs hides anything)."""
    binds, links = [], []
    for p in sorted(os.path.normpath(p) for p in host_paths):
        if any(p.startswith(b + "/") for b, _ in binds):
            continue  # already inside a recursive bind; a mkdir for it would land on the host
        if os.path.islink(p):
            links.append((p, os.readlink(p)))
        elif os.path.isdir(p):
            binds.append((p, os.open(p, os.O_PATH | os.O_DIRECTORY)))
    return binds, links


def _build_root(workspace, host_paths):
    """Steps 3 and 4, in PID 1 (a fresh /proc must be mounted from inside the PID namespace,
    and before the old root goes, or a user namespace may not mount it)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    ws_fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY)
    binds, links = _bind_host_paths(host_paths)
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    r = NEW_ROOT
    for path, fd in binds:
        os.makedirs(r + path, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", r + path, None, MS_BIND | MS_REC)
        os.close(fd)
    for path, target in links:
        os.makedirs(os.path.dirname(r + path), exist_ok=True)
        os.symlink(target, r + path)
    os.makedirs(r + "/dev", exist_ok=True)
    _mount("tmpfs", r + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{r}/dev/{name}", "w").close()
            _mount("/dev/" + name, f"{r}/dev/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{r}/dev/{name}")
    os.makedirs(r + JAIL_WORKSPACE)
    _mount(f"/proc/self/fd/{ws_fd}", r + JAIL_WORKSPACE, None, MS_BIND)
    os.close(ws_fd)
    os.makedirs(r + "/proc")
    try:
        _mount("proc", r + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass  # (a locked-down container) the PID namespace still bounds the tree; /proc stays empty
    # Read before the pivot, through the host's /proc: the new one may have failed to mount.
    with open("/proc/self/mountinfo", "rb") as f:
        mounts = mounts_beneath(parse_mountinfo(f.read()), r)
    os.chdir(r)
    nr = _SYS_PIVOT_ROOT.get(platform.machine())
    if nr is None:
        raise OSError(0, f"pivot_root: no syscall number known for {platform.machine()}")
    # pivot_root(".", "."): the old root ends up stacked on the new one, then is detached.
    _check(_libc.syscall(nr, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    devices = {"/dev/" + name for name in DEVICES}
    for point, flags in mounts:
        if point in (JAIL_WORKSPACE, "/proc") or point.startswith("/proc/") or point in devices:
            continue
        # Fail closed: a mount left writable is a hole, so any error ends the jail here.
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


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


def _jail_init(spec):
    """PID 1 of the jail: build the root, drop to the sandbox uid, exec the command."""
    mode = spec["mode"]
    _build_root(spec["workspace"], spec["host_paths"])
    os.chdir(JAIL_WORKSPACE)
    if mode == "root":
        uid = gid = spec["uid"]
        _chown_tree(JAIL_WORKSPACE, uid, gid)
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    _set_limits(spec["limits"])
    # After the uid change (a credential change clears it); a second line behind the
    # harness's kill of this pid: if the process outside dies, so does the jail.
    _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)


def main() -> None:
    spec = json.loads(sys.argv[1])
    env = spec["env"]
    mode = spec["mode"]
    if mode in ("root", "userns"):
        # If the harness dies, this process dies, and with it PID 1 (its parent-death signal).
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        if mode == "userns":
            _enter_user_namespace()
        _unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
        pid = os.fork()  # the child is PID 1 of the new PID namespace
        if pid:
            os.write(spec["pid_fd"], f"{pid}\n".encode())
            os.close(spec["pid_fd"])
            _, status = os.waitpid(pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
        os.close(spec["pid_fd"])
        try:
            _jail_init(spec)
        except OSError as exc:
            os.write(2, f"jail setup failed, command not run: {exc}\n".encode())
            os._exit(EXIT_JAIL_FAILED)
    else:
        os.close(spec["pid_fd"])
        os.chdir(spec["workspace"])
        _set_limits(spec["limits"])
    os.umask(0o022)
    os.execve("/bin/sh", ["sh", "-c", spec["command"]], env)


if __name__ == "__main__":
    main()

"""Open paths beneath a directory in one step a concurrent symlink swap cannot redirect.

Why not ``realpath`` then ``open``: those are two steps, and a process that swaps a file or
a directory for a symlink between them (a jail leftover, a second run on the workspace)
redirects the open outside; ``O_NOFOLLOW`` covers only the last component. Here:

- ``openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`` (Linux 5.6+): the kernel resolves the
  whole path relative to the workspace's directory fd and fails with EXDEV when any step
  (``..``, an absolute symlink, a relative one climbing out) would leave it; symlinks that
  stay inside still work. A rename during the walk makes it fail with EAGAIN (retried);
- older kernels: a walk one component at a time with ``O_NOFOLLOW`` from directory fds, no
  symlink followed anywhere, ``..`` resolved lexically (safe only because no link is).

``walk`` lists a tree iteratively, one directory fd at a time, climbing back through ``..``
checked against the inode it left from, so neither depth (a 3,000-deep chain outgrows both
PATH_MAX and Python's recursion limit) nor a concurrent rename can take it elsewhere.

Standard library only: ``sandbox_exec.py`` imports it as a plain module inside the jail setup.
"""
from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat
from typing import Iterator

SYS_OPENAT2 = 437  # one number on every architecture (added after the syscall tables merged)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_have_openat2: bool | None = None


def _openat2(dir_fd: int, path: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    raw = os.fsencode(path)
    for _ in range(64):
        fd = _libc.syscall(SYS_OPENAT2, dir_fd, raw, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, "the path kept changing while it was opened", path)


def _walk_open(dir_fd: int, path: str, flags: int, mode: int) -> int:
    parts = [p for p in posixpath.normpath(path).split("/") if p not in ("", ".")]
    if parts[:1] == [".."]:
        raise OSError(errno.EXDEV, "path leaves the directory", path)
    cur = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
            os.close(cur)
            cur = nxt
        last = parts[-1] if parts else "."
        return os.open(last, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=cur)
    finally:
        os.close(cur)


def open_beneath(dir_fd: int, path: str, flags: int, mode: int = 0o644, use_openat2: bool | None = None) -> int:
    """An fd for ``path`` resolved strictly beneath ``dir_fd``; OSError(EXDEV) when it would leave.

    ``use_openat2=None`` picks openat2 where the kernel has it, else the component walk.
    """
    global _have_openat2
    if not path or "\x00" in path or path.startswith("/"):
        raise OSError(errno.EXDEV, "path is empty, absolute or holds a NUL byte", path)
    if use_openat2 is None:
        if _have_openat2 is None:
            try:
                os.close(_openat2(dir_fd, ".", os.O_PATH, 0))
                _have_openat2 = True
            except OSError as exc:
                _have_openat2 = exc.errno not in (errno.ENOSYS, errno.EPERM)
        use_openat2 = _have_openat2
    return (_openat2 if use_openat2 else _walk_open)(dir_fd, path, flags, mode)


def makedirs_beneath(dir_fd: int, path: str) -> int:
    """An O_PATH fd for directory ``path`` beneath ``dir_fd``, creating missing components."""
    try:
        return open_beneath(dir_fd, path, os.O_PATH | os.O_DIRECTORY)
    except FileNotFoundError:
        pass
    cur = os.dup(dir_fd)
    try:
        for part in [p for p in posixpath.normpath(path).split("/") if p not in ("", ".")]:
            try:
                nxt = open_beneath(cur, part, os.O_PATH | os.O_DIRECTORY)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o755, dir_fd=cur)
                except FileExistsError:
                    pass
                nxt = open_beneath(cur, part, os.O_PATH | os.O_DIRECTORY)
            os.close(cur)
            cur = nxt
        return os.dup(cur)
    finally:
        os.close(cur)


def walk(dir_fd: int, max_entries: int = 1_000_000) -> Iterator[tuple[str, os.stat_result, int, str]]:
    """(relative path, lstat, parent's fd, name) of every entry beneath ``dir_fd``, directories
    before their contents. The parent's fd is valid until the next item: act on an entry
    through it (``dir_fd=``), since the relative path may be longer than PATH_MAX.

    Never follows a symlink; holds one directory fd at a time whatever the depth; stops
    (RuntimeError) when a directory it climbs back to is no longer the one it came from, and
    after ``max_entries`` entries, so a hostile tree costs bounded time.
    """
    cur = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    # one frame per level: (names still to visit, path prefix, (dev, ino) of this directory)
    top = os.fstat(cur)
    stack = [(sorted(os.listdir(cur), reverse=True), "", (top.st_dev, top.st_ino))]
    seen = 0
    try:
        while stack:
            names, prefix, _ = stack[-1]
            if not names:
                stack.pop()
                if stack:
                    up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
                    os.close(cur)
                    cur = up
                    st = os.fstat(cur)
                    if (st.st_dev, st.st_ino) != stack[-1][2]:
                        raise RuntimeError("a directory was moved while the tree was walked")
                continue
            name = names.pop()
            seen += 1
            if seen > max_entries:
                raise RuntimeError(f"more than {max_entries} entries")
            try:
                st = os.stat(name, dir_fd=cur, follow_symlinks=False)
            except FileNotFoundError:
                continue
            rel = prefix + name
            yield rel, st, cur, name
            if stat.S_ISDIR(st.st_mode):
                try:
                    down = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
                except OSError:
                    continue  # swapped for a link or removed since the stat: not followed
                dst = os.fstat(down)
                if (dst.st_dev, dst.st_ino) != (st.st_dev, st.st_ino):
                    os.close(down)
                    continue
                os.close(cur)
                cur = down
                stack.append((sorted(os.listdir(cur), reverse=True), rel + "/", (dst.st_dev, dst.st_ino)))
    finally:
        os.close(cur)


def remove_tree(path: str | os.PathLike) -> None:
    """``rm -r path`` holding one directory fd at a time (``shutil.rmtree`` recurses per level
    and raises RecursionError on a tree a model can build in one command). Links are removed,
    never followed; a directory moved away mid-removal stops it (RuntimeError)."""
    path = os.path.abspath(path)
    cur = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    stack: list[tuple[str, tuple[int, int]]] = []   # (name in parent, (dev, ino) of parent)
    try:
        while True:
            sub = None
            for name in os.listdir(cur):
                if stat.S_ISDIR(os.stat(name, dir_fd=cur, follow_symlinks=False).st_mode):
                    sub = name
                    break
                os.unlink(name, dir_fd=cur)
            if sub is not None:
                here = os.fstat(cur)
                down = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
                stack.append((sub, (here.st_dev, here.st_ino)))
                os.close(cur)
                cur = down
                continue
            if not stack:
                break
            name, parent = stack.pop()
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
            os.close(cur)
            cur = up
            st = os.fstat(cur)
            if (st.st_dev, st.st_ino) != parent:
                raise RuntimeError(f"a directory under {path} was moved during its removal")
            os.rmdir(name, dir_fd=cur)
    finally:
        os.close(cur)
    os.rmdir(path)

"""What a workspace holds, as a value two trees can be compared by (the snapshot and resume tests)."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed, directories named in ``skip`` left out):
    kind, permission bits, content or target."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [n for n in dirs if n not in skip]
        for n in dirs + files:
            p = Path(d) / n
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mode & 0o777)
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = ("fifo", st.st_mode & 0o777)
            else:
                out[rel] = ("file", st.st_mode & 0o777, p.read_bytes())
    return out

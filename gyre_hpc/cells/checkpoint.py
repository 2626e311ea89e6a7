"""Fleet checkpoints: ``checkpoints/step-XXXXXXXX/`` plus a ``latest`` pointer.

Why the pointer is written last and atomically: the supervisor may kill the fleet at any
moment; a reader that follows ``latest`` must only ever find a complete directory. So the
directory is filled under a ``.tmp`` name, made durable and renamed into place
(``fsio.replace_dir``), and only then does ``latest`` (``fsio.write_text``) name it. Leftover
``.tmp`` dirs from a killed writer are ignored and cleaned. The last ``keep`` complete
checkpoints are kept.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gyre_hpc import fsio
from gyre_hpc.models.checkpoint import CheckpointError
from gyre_hpc.rundir.layout import CHECKPOINT_LATEST, CHECKPOINT_META

STATE_FILE = "model.safetensors"


@dataclass
class CheckpointMeta:
    step: int                          # last completed step
    policy_version: int
    roles: dict[str, str]              # cell id (as str, JSON keys) -> Role value
    time: float = field(default_factory=time.time)
    files: list[str] = field(default_factory=lambda: [STATE_FILE])
    extra: dict = field(default_factory=dict)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    """A fresh, empty directory to fill; removed first if a killed writer left it."""
    tmp = Path(root) / (step_dir_name(step) + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def write_state(directory: Path, state: dict[str, torch.Tensor]) -> None:
    # safetensors refuses tensors that share storage or are not contiguous; clone what must be.
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    path = Path(directory) / STATE_FILE
    with fsio.naming_full_disk(path):
        save_file(tensors, str(path))


def commit(root: Path, step: int, meta: CheckpointMeta, keep: int = 2) -> Path:
    """Seal the staged directory of ``step``: meta.json, rename into place, repoint latest, prune."""
    root = Path(root)
    tmp = root / (step_dir_name(step) + ".tmp")
    for name in meta.files:
        if not (tmp / name).is_file():
            raise CheckpointError(f"checkpoint {tmp}: {name} was not written; refusing to commit")
    fsio.write_text(tmp / CHECKPOINT_META, json.dumps(asdict(meta), indent=2))
    final = root / step_dir_name(step)
    current = latest_dir(root)
    if final.exists() and current is not None and current.resolve() == final.resolve():
        # Sealed already and named by latest: never replace what latest points at.
        shutil.rmtree(tmp)
    else:
        # A dir latest does not name is from a writer killed before it repointed latest; the
        # relaunch reran that step, and its state is the one the fleet now continues from.
        fsio.replace_dir(tmp, final)
    fsio.write_text(root / CHECKPOINT_LATEST, step_dir_name(step) + "\n")
    prune(root, keep)
    return final


def complete_dirs(root: Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if p.is_dir() and p.name.startswith("step-") and not p.name.endswith(".tmp")
                  and (p / CHECKPOINT_META).is_file())


def prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (never the one latest names) and drop stale tmp dirs."""
    root = Path(root)
    fsio.recover_dirs(root)     # a step replaced by a writer killed between its renames
    current = latest_dir(root)
    dirs = complete_dirs(root)
    for old in dirs[:-keep] if keep > 0 else dirs:
        if current is None or old.resolve() != current.resolve():
            shutil.rmtree(old, ignore_errors=True)
    newest = dirs[-1].name if dirs else ""
    for p in root.iterdir():
        if p.is_dir() and p.name.endswith(".tmp") and p.name[:-4] < newest:
            shutil.rmtree(p, ignore_errors=True)


def latest_dir(root: Path) -> Path | None:
    """The directory ``latest`` names, or None when there is no checkpoint yet."""
    pointer = Path(root) / CHECKPOINT_LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    d = Path(root) / name
    if not (d / CHECKPOINT_META).is_file():
        raise CheckpointError(f"{pointer} names {name!r}, but {d / CHECKPOINT_META} does not exist")
    return d


def read_meta(directory: Path) -> CheckpointMeta:
    path = Path(directory) / CHECKPOINT_META
    try:
        data = json.loads(path.read_text())
        return CheckpointMeta(**data)
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise CheckpointError(f"checkpoint meta {path} is unreadable: {exc}") from None


def load_state(directory: Path) -> dict[str, torch.Tensor]:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: {STATE_FILE} is missing")
    return load_file(str(path))

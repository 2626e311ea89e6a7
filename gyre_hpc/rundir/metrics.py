"""``metrics.h5``: the cell timeline, per-step figures and engine figures of a run.

HDF5 in SWMR mode so a notebook can read a live run. SWMR forbids creating datasets once
the writer is in SWMR mode, so every table is created up front with a fixed schema; rows
are appended by resizing. Exactly one process writes at a time: the supervisor between
fleet launches, the controller rank while the fleet runs (the file is closed in between).
The simulator writes the same schema, so analysis code cannot tell the two apart.
"""
from __future__ import annotations

import contextlib
import threading
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Protocol

import h5py
import numpy as np

from gyre_hpc import fsio

SCHEMA_VERSION = 1
# Fixed-width byte strings, not variable-length ones: HDF5 keeps vlen strings in a global
# heap that SWMR readers cannot follow (reads fail with "address past end of allocation").
_STR = "S32"
_TEXT = "S160"

# HDF5 keeps one open file per path in a process, shared by every handle on it. A reader opened
# here while this process's writer is open keeps the writer's file (in SWMR-write mode) alive
# after the writer closes; the next writer here then joins that file and cannot start SWMR
# ("file already in SWMR writing mode"). The head's event writer met its own progress thread so
# in CI. Readers hold this lock from open to close, writers while they open and close, so a
# writer never joins a file a reader kept alive, and a long-lived writer (the fleet's) never
# blocks this process's readers.
_HANDLES = threading.RLock()

# table -> ordered (column, dtype). Roles: ROLLOUT, TRAIN, SWITCH, IDLE, DOWN.
TABLES: dict[str, list[tuple[str, Any]]] = {
    # One row per event on a cell: role changes (start/end of a flip), launches, relaunches,
    # KV moves (``migrate``: in-flight requests + retained agent contexts moved, their
    # cached KV tokens and bytes; ``sessions``/``session_tokens``: the session contexts' share).
    "timeline": [
        ("time", "f8"), ("cell", "i4"), ("role", _STR), ("event", _STR), ("step", "i4"),
        ("duration_s", "f8"), ("bytes", "i8"), ("detail", _TEXT), ("requests", "i4"), ("tokens", "i8"),
        ("sessions", "i4"), ("session_tokens", "i8"),
    ],
    # recomputed_prefill_tokens: prompt/KV tokens the engines prefilled again during the step
    # (a moved sequence whose cache did not travel); 0 with KV migration.
    # logprob_gap_*: |trainer - behaviour| logprob over the step's trained targets before its
    # update (trees.loss.LogprobGap); pre_update_clip_share: targets whose ratio was clipped
    # before any policy change; behaviour_kl: k3 estimate of KL(behaviour || trainer). All 0.0
    # with model.numerics invariant and TorchEngine; NaN where the step trained nothing.
    "steps": [
        ("step", "i4"), ("time", "f8"), ("wall_s", "f8"), ("tokens", "i8"), ("replicas", "i4"),
        ("loss", "f8"), ("reward_mean", "f8"), ("policy_version", "i4"), ("recomputed_prefill_tokens", "i8"),
        ("logprob_gap_max", "f8"), ("logprob_gap_mean", "f8"), ("pre_update_clip_share", "f8"), ("behaviour_kl", "f8"),
    ],
    "engines": [
        ("time", "f8"), ("cell", "i4"), ("tokens_per_s", "f8"), ("queued", "i4"),
        ("inflight", "i4"), ("tokens_inflight", "i8"),
    ],
    # Supervisor and job-level events: launch, relaunch, requeue, resume, finish.
    "events": [("time", "f8"), ("event", _STR), ("step", "i4"), ("detail", _TEXT)],
    # One row per finished agent run (rl workload): how flips touched it. restarts must stay 0.
    # ``started``: when the run took its place in the harness pool (unix time; async runs of
    # step s+1 start while step s's last runs still roll out); 0 for a tree read from the store.
    # A run a relaunch found unfinished (issue 53): ``resumed_calls`` of its calls came from its
    # journal (no engine call), ``tools_redone`` of those ran their tools again after its
    # workspace snapshot (at most rollout.snapshot_every), ``restarted_from_first`` 1 if its
    # journal was abandoned and it began again at call 0. All 0 for a run never interrupted.
    "runs": [
        ("time", "f8"), ("step", "i4"), ("run_id", _STR), ("task_id", _STR), ("status", _STR),
        ("reward", "f8"), ("wall_s", "f8"), ("calls", "i4"), ("migrations", "i4"), ("restarts", "i4"),
        ("policy_version", "i4"), ("model_s", "f8"), ("started", "f8"),
        ("resumed_calls", "i4"), ("tools_redone", "i4"), ("restarted_from_first", "i4"),
    ],
}


@dataclass
class TimelineRow:
    time: float
    cell: int
    role: str
    event: str
    step: int = -1
    duration_s: float = 0.0
    bytes: int = 0
    detail: str = ""
    requests: int = 0      # migrate: in-flight requests + retained session contexts moved
    tokens: int = 0        # migrate: their cached KV tokens
    sessions: int = 0      # migrate: of ``requests``, the retained session contexts
    session_tokens: int = 0  # migrate: of ``tokens``, theirs


@dataclass
class StepRow:
    step: int
    time: float
    wall_s: float
    tokens: int = 0
    replicas: int = 0
    loss: float = float("nan")
    reward_mean: float = float("nan")
    policy_version: int = 0
    recomputed_prefill_tokens: int = 0
    logprob_gap_max: float = float("nan")
    logprob_gap_mean: float = float("nan")
    pre_update_clip_share: float = float("nan")
    behaviour_kl: float = float("nan")


@dataclass
class EngineRow:
    time: float
    cell: int
    tokens_per_s: float
    queued: int = 0
    inflight: int = 0
    tokens_inflight: int = 0


@dataclass
class EventRow:
    time: float
    event: str
    step: int = -1
    detail: str = ""


@dataclass
class RunRow:
    time: float
    step: int
    run_id: str
    task_id: str
    status: str
    reward: float
    wall_s: float = 0.0
    calls: int = 0
    migrations: int = 0
    restarts: int = 0
    policy_version: int = 0
    model_s: float = 0.0       # wall time the run spent waiting on model calls (the rest is tools)
    started: float = 0.0       # unix time the run took its harness place (0: read from the store)
    resumed_calls: int = 0     # calls replayed from the run's journal after a relaunch
    tools_redone: int = 0      # of those, the calls whose tools ran again (after the snapshot)
    restarted_from_first: int = 0   # 1: the journal was abandoned, the run began again at call 0


_ROW_TABLE = {TimelineRow: "timeline", StepRow: "steps", EngineRow: "engines", EventRow: "events",
              RunRow: "runs"}


class RowMirror(Protocol):
    """A second destination for the rows (TensorBoard, wandb); it sees each row after metrics.h5 has it."""

    def append(self, rows: list) -> None: ...

    def close(self) -> None: ...


class Mirrors:
    """Several mirrors as one (TensorBoard and wandb together)."""

    def __init__(self, mirrors: list):
        self.mirrors = mirrors

    def append(self, rows: list) -> None:
        for m in self.mirrors:
            m.append(rows)

    def close(self) -> None:
        for m in self.mirrors:
            m.close()


def _open_for_write(path: Path, wait_s: float = 30.0) -> h5py.File:
    """Open for appending, waiting out readers: an SWMR reader in another process (a notebook,
    ``inspect``, a test polling) holds HDF5's file lock while it opens the file, and a writer
    arriving in that moment gets EAGAIN; the head opens the file for each event, so without the
    wait a reader could crash it. This process's own readers are kept out by ``_HANDLES``; one
    opened with h5py directly (a notebook kernel, a thread of the caller's) makes HDF5 refuse
    the open outright ("already open for read-only") until it closes: waited out the same way."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return h5py.File(path, "a", libver="latest")
        except OSError as exc:
            busy = isinstance(exc, BlockingIOError) or "already open for read-only" in str(exc)
            if not busy or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def open_for_read(path: Path | str, wait_s: float = 30.0) -> Iterator[h5py.File]:
    """Open as an SWMR reader, waiting out a writer's setup: between opening the file and
    switching to SWMR mode (creating columns, setting attributes) the writer holds HDF5's lock
    exclusively, and a reader arriving in that moment gets EAGAIN. The head reopens the file
    for each event, so a notebook or a test polling a live run meets that window; CI saw a
    poll of ``events`` fail with BlockingIOError errno 11 as a requeued head resumed."""
    deadline = time.monotonic() + wait_s
    with _HANDLES:
        while True:
            try:
                f = h5py.File(path, "r", libver="latest", swmr=True)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            yield f
        finally:
            f.close()


class MetricsWriter:
    """Single writer of ``metrics.h5``; appends rows and flushes so SWMR readers see them."""

    def __init__(self, path: str | Path, attrs: dict[str, Any] | None = None, mirror: RowMirror | None = None):
        self.path = Path(path)
        self._mirror = mirror
        self._attrs = attrs
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with fsio.naming_full_disk(self.path):
            self._open()

    def _open(self) -> None:
        with _HANDLES:
            self._open_swmr()

    def _open_swmr(self) -> None:
        self._f = _open_for_write(self.path)
        for table, cols in TABLES.items():
            grp = self._f.require_group(table)
            present = [col for col, _ in cols if col in grp]
            rows = grp[present[-1]].shape[0] if present else 0
            for col, dtype in cols:
                if col in grp and grp[col].shape[0] > rows:
                    # A row a killed writer began and never finished (read_table never shows it):
                    # cut, so this writer's rows line up in every column.
                    grp[col].resize((rows,))
                elif col not in grp:
                    # A column newer than the file: its existing rows read as 0 / "".
                    grp.create_dataset(col, shape=(rows,), maxshape=(None,), dtype=dtype, chunks=(1024,),
                                       fillvalue=b"" if str(dtype).startswith("S") else 0)
        self._f.attrs["schema_version"] = SCHEMA_VERSION
        for k, v in (self._attrs or {}).items():
            self._f.attrs[k] = v
        self._f.swmr_mode = True

    def append(self, rows: Iterable[TimelineRow | StepRow | EngineRow | EventRow | RunRow]) -> None:
        rows = list(rows)
        with fsio.naming_full_disk(self.path):
            self._append(rows)
        if self._mirror is not None:
            self._mirror.append(rows)

    def _append(self, rows: list) -> None:
        by_table: dict[str, list] = {}
        for row in rows:
            by_table.setdefault(_ROW_TABLE[type(row)], []).append(row)
        for table, items in by_table.items():
            grp = self._f[table]
            n = grp[TABLES[table][0][0]].shape[0]
            for col, _ in TABLES[table]:
                ds = grp[col]
                ds.resize((n + len(items),))
                values = [getattr(r, col) for r in items]
                if ds.dtype.kind == "S":
                    width = ds.dtype.itemsize
                    values = [str(v).encode()[:width] for v in values]
                ds[n:] = values
                ds.flush()

    def add(self, row: TimelineRow | StepRow | EngineRow | EventRow | RunRow) -> None:
        self.append([row])

    def event(self, event: str, step: int = -1, detail: str = "") -> None:
        self.add(EventRow(time=time.time(), event=event, step=step, detail=detail))

    def close(self) -> None:
        if self._f:
            with _HANDLES:
                self._f.close()
            self._f = None
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_table(path: str | Path, table: str) -> dict[str, np.ndarray]:
    """Read one table's complete rows as columns; works on a live file (SWMR) and on a closed one.

    The writer grows a table one column at a time, in schema order, so a reader of a live file
    (or of one whose writer was killed mid-append) can find some columns a row longer than
    others. The schema's last column is written last: its length, read before any other
    column, counts the rows every column has finished, and every column is cut to it.
    """
    if table not in TABLES:
        raise KeyError(f"unknown metrics table {table!r}; valid: {', '.join(TABLES)}")
    with open_for_read(path) as f:
        grp = f[table]
        # A file written before a column joined the schema lacks it: its rows read as 0 / "".
        present = [col for col, _ in TABLES[table] if col in grp]
        last = grp[present[-1]]
        last.refresh()
        rows = last.shape[0]
        out = {}
        for col, dtype in TABLES[table]:
            if col not in grp:
                out[col] = (np.array([""] * rows, dtype=object) if str(dtype).startswith("S")
                            else np.zeros(rows, dtype=dtype))
                continue
            ds = grp[col]
            ds.refresh()
            data = ds[:rows]
            if data.dtype.kind == "S":
                data = np.array([x.decode(errors="replace") for x in data], dtype=object)
            out[col] = data
        return out


def recover_unclosed(path: str | Path) -> bool:
    """Make a file whose writer was killed writable again; True when it had to.

    A writer killed mid-run (a scancel'd fleet step) leaves HDF5's SWMR-write flag set in the
    superblock, and HDF5 then refuses every later writer ("file is already open for write";
    h5clear is not always installed). SWMR readers still open such a file, so every table and
    attribute is copied into a fresh file that replaces it: no row already stored is lost.
    Call it only while no writer runs: a live SWMR writer looks exactly like a dead one.
    """
    path = Path(path)
    if not path.exists():
        return False
    try:
        with _HANDLES, h5py.File(path, "r"):
            return False
    except OSError as exc:
        if "already open for write" not in str(exc):
            raise
    # The copy needs about the file's size. HDF5 that runs out of space mid-copy can leave
    # handles that crash the interpreter when freed (a segfault in h5py's dealloc, seen on a
    # full tmpfs), so a copy that cannot fit is refused before it starts.
    if shutil.disk_usage(path.parent).free < path.stat().st_size:
        raise fsio.DiskFullError(path, f"copying its rows to a fresh file needs ~{path.stat().st_size >> 10} KiB")
    with open_for_read(path) as src:
        attrs = dict(src.attrs)
        present = [table for table in TABLES if table in src]
    tables = {table: read_table(path, table) for table in present}
    tmp = path.with_name(path.name + ".recovering")
    tmp.unlink(missing_ok=True)
    row_types = {table: row_type for row_type, table in _ROW_TABLE.items()}
    try:
        with MetricsWriter(tmp, attrs=attrs) as writer:
            for table, cols in tables.items():
                # read_table keeps complete rows only: the row a kill tore mid-append is dropped.
                n = len(cols[TABLES[table][0][0]])
                writer.append(row_types[table](**{c: cols[c][i] for c, _ in TABLES[table]}) for i in range(n))
        fsio.replace_file(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)   # the original is untouched; a full disk gets its space back
        if fsio.is_disk_full(exc) and not isinstance(exc, fsio.DiskFullError):
            raise fsio.DiskFullError(path, "copying its rows to a fresh file") from exc
        raise
    return True

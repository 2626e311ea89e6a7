"""``trees.zarr``: the trajectory tree store, one writer (the controller), many readers.

A store is a Zarr v3 group of flat 1-D arrays (``store_schema``) plus ``commit.json``
(``store_commit``). ``append`` writes the new rows of every array, fsyncs them, and only then
publishes a new commit marker; readers never look past the marker. So a writer killed at any
instant leaves a store holding exactly the trees of its last commit, and the next writer
truncates whatever the dead one left beyond it. Chunk files and Zarr metadata are replaced
atomically by Zarr's LocalStore (temp file + rename), so a reader never sees half a chunk and
the committed prefix of the trailing chunk survives its rewrite.

Why no Zarr sharding: a sharded read fetches the shard index and the inner chunk with two
separate file reads; with the writer replacing that shard in between, a live reader could
pair an old index with new bytes. Whole-chunk files are read in one go, so live readers are
safe; ``StoreLayout`` sizes chunks so file counts stay modest.

Not thread-safe: one ``TreeStore`` object per thread.
"""
from __future__ import annotations

import asyncio
import fcntl
import os
import re
import shutil
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import zarr
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.core.sync import sync
from zarr.storage import LocalStore

from gyre_hpc import fsio
from gyre_hpc.trees.model import Tree
from gyre_hpc.trees.store_commit import (
    CONTROL_DIR, MARKER_NAME, ChunkCorruptError, CommitMarker, CorruptChunk, StoreError, chunk_checksum,
    marker_path, read_marker, write_marker,
)
from gyre_hpc.trees.store_schema import (
    ARRAYS, DIMS, READ_VERSIONS, SCHEMA_VERSION, SPECS, InvalidTreeError, StoreLayout, arrays_of, dim_lengths,
    flatten_trees, tree_from_columns, validate_tree,
)

__all__ = [
    "TreeStore", "StoreLayout", "StoreError", "ChunkCorruptError", "CorruptChunk",
    "InvalidTreeError", "VerifyReport", "CommitMarker",
]

ATTR_KEY = "gyre_tree_store"
LOCK_NAME = "writer.lock"   # in CONTROL_DIR beside the marker
# Leftovers of writes killed mid-way: Zarr LocalStore's "<key>.<uuid hex>.partial" and the
# marker's temporary file (``fsio.is_temp``). Never part of a commit, removed by the next writer.
_ZARR_PARTIAL = re.compile(r"\.[0-9a-f]{32}\.partial$")
_CACHE_PER_ARRAY = 4
_TOKEN_ARRAYS = ("tokens", "logprobs", "trained")
_NODE_ARRAYS = ("node_start", "node_len", "parent", "role")
_CALL_ARRAYS = ("call_node", "call_role", "call_agent")
_SAMPLE_ARRAYS = ("sample_token", "sample_logprob", "sample_call")


@dataclass(frozen=True)
class VerifyReport:
    """A clean ``verify()``: how much committed data was read back and checked."""

    chunks: int
    rows: dict[str, int]
    generation: int


class TreeStore:
    """Open with ``TreeStore.open(path, mode)``: ``"r"`` to read, ``"a"`` to append
    (creating the store if the path does not exist). One writer at a time, enforced by an
    flock on ``writer.lock`` (released by the kernel if the writer dies)."""

    def __init__(self, root: Path, group: zarr.Group, layout: StoreLayout, marker: CommitMarker,
                 writable: bool, lock_fd: int | None, durable: bool):
        self.root = root
        self.schema_version = marker.schema_version
        self._specs = arrays_of(self.schema_version)
        self.layout = layout
        self._group = group
        self._marker = marker
        self._writable = writable
        self._lock_fd = lock_fd
        self._durable = durable
        self._arrays = {s.name: _array(group, s.name) for s in self._specs}
        self._cache: dict[str, OrderedDict[int, np.ndarray]] = {s.name: OrderedDict() for s in self._specs}

    # ---- opening ---------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, mode: str = "r", layout: StoreLayout | None = None,
             durable: bool = True) -> "TreeStore":
        """``layout`` applies when ``mode="a"`` creates the store; given for an existing store
        it must match. ``durable=False`` skips durability against power loss (not against a
        killed process), for tests and scratch runs."""
        if mode not in ("r", "a"):
            raise ValueError(f"TreeStore.open mode={mode!r}: valid modes are 'r' (read) and 'a' (append)")
        root = Path(path).absolute()
        if mode == "a" and not root.exists():
            _create(root, layout or StoreLayout(), durable)
        group, stored_layout, version = _open_group(root, writable=mode == "a")
        if layout is not None and layout != stored_layout:
            raise StoreError(f"{root / 'zarr.json'}: store was created with {stored_layout}, asked for {layout}")
        lock_fd = _lock_writer(root) if mode == "a" else None
        try:
            marker = read_marker(root)
            if marker.schema_version != version:
                raise StoreError(f"{marker_path(root)}: schema_version {marker.schema_version}, "
                                 f"but {root / 'zarr.json'} says {version}")
            _check_marker_fits(root, marker, stored_layout)
            store = cls(root, group, stored_layout, marker, mode == "a", lock_fd, durable)
            if mode == "a":
                store._recover()
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        return store

    def _recover(self) -> None:
        """Make the store exactly its last commit: drop temp files and rows past the marker,
        check the committed tail we are about to extend, and reopen for streams."""
        for p in self.root.rglob("*"):
            if p.is_file() and (_ZARR_PARTIAL.search(p.name) or fsio.is_temp(p.name)):
                p.unlink(missing_ok=True)
        self._truncate_to_marker()
        for spec in self._specs:
            n_chunks = len(self._marker.checksums[spec.name])
            if n_chunks:
                self._chunk(spec.name, n_chunks - 1, cache=False)
        if self._marker.closed:
            self._publish(self._marker.with_closed(False))

    def _truncate_to_marker(self) -> None:
        for spec in self._specs:
            arr = _array(self._group, spec.name)
            n = self._marker.lengths[spec.dim]
            if arr.shape[0] > n:
                arr.resize((n,))
            elif arr.shape[0] < n:
                raise StoreError(
                    f"{self.root / spec.name / 'zarr.json'}: array {spec.name} holds {arr.shape[0]} rows "
                    f"but {marker_path(self.root)} commits {n}")
            self._arrays[spec.name] = arr

    # ---- state -----------------------------------------------------------------------

    @property
    def marker(self) -> CommitMarker:
        """The commit this object reads up to (a checkpoint records its generation/lengths)."""
        return self._marker

    def __len__(self) -> int:
        return self._marker.n_trees

    def refresh(self) -> int:
        """Re-read the commit marker (readers); returns the committed tree count."""
        if self._writable:
            return len(self)
        marker = read_marker(self.root)
        if marker.generation != self._marker.generation:
            shrunk = [d for d in marker.lengths if marker.lengths[d] < self._marker.lengths[d]]
            if shrunk:
                raise StoreError(
                    f"{marker_path(self.root)}: committed rows went back on dims {shrunk} "
                    f"(generation {self._marker.generation} -> {marker.generation}); the store was replaced")
            self._marker = marker
        return len(self)

    # ---- writing ---------------------------------------------------------------------

    def append(self, trees: Iterable[Tree]) -> range:
        """Append ``trees`` as one commit; returns their tree indices. All are validated
        first, so a bad tree raises ``InvalidTreeError`` with nothing written."""
        if not self._writable:
            raise StoreError(f"{self.root}: opened read-only; open with mode='a' to append")
        trees = list(trees)
        for k, tree in enumerate(trees):
            validate_tree(tree, f"trees[{k}]")
        start = len(self)
        if not trees:
            return range(start, start)
        old = self._marker
        columns = flatten_trees(trees, old.lengths)
        new = old.extended(columns)
        added = dim_lengths(columns)
        try:
            sync(_write_all(self._arrays, old, new, columns, added))
            if self._durable:
                self._sync_written(old, new)
        except BaseException as exc:
            try:
                self._truncate_to_marker()
            except Exception:
                pass    # the next open for writing truncates again
            if fsio.is_disk_full(exc):
                raise fsio.DiskFullError(self.root, f"append of {len(trees)} trees failed, nothing committed") from exc
            if isinstance(exc, Exception) and not isinstance(exc, StoreError):
                raise StoreError(f"{self.root}: append of {len(trees)} trees failed, nothing committed: {exc}") from exc
            raise
        self._publish(new)
        return range(start, len(self))

    def _publish(self, marker: CommitMarker) -> None:
        write_marker(self.root, marker, durable=self._durable)
        self._marker = marker

    def _sync_written(self, old: CommitMarker, new: CommitMarker) -> None:
        """Make this append's chunk files, metadata and directory entries durable before the
        marker names them."""
        files, dirs = [], set()
        for spec in ARRAYS:
            lo, hi = old.lengths[spec.dim], new.lengths[spec.dim]
            if hi == lo:
                continue
            chunk = new.chunks[spec.dim]
            adir = self.root / spec.name
            files += [adir / "c" / str(k) for k in range(lo // chunk, (hi - 1) // chunk + 1)]
            files.append(adir / "zarr.json")
            dirs.update((adir, adir / "c"))
        fsio.sync_paths(files)
        fsio.sync_paths(dirs)

    def close(self) -> None:
        """Writers mark the store closed (streams stop once caught up) and drop the lock."""
        if self._lock_fd is None:
            return
        try:
            if not self._marker.closed:
                self._publish(self._marker.with_closed(True))
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None
            self._writable = False

    def __enter__(self) -> "TreeStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading ---------------------------------------------------------------------

    def read(self, i: int) -> Tree:
        """Committed tree ``i`` (negative counts from the end); every chunk it touches is
        checked against the commit marker, so damage raises ``ChunkCorruptError``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"tree {i} out of range: {self.root} has {n} committed trees")
        i %= n
        row = {s.name: self._rows(s.name, i, i + 1)[0] for s in self._specs if s.dim == "tree"}
        spans = {
            "token": (row["token_offset"], row["n_tokens"]), "node": (row["node_offset"], row["n_nodes"]),
            "call": (row["call_offset"], row["n_paths"]), "dropped": (row["dropped_offset"], row["n_dropped"]),
        }
        names = (*_TOKEN_ARRAYS, *_NODE_ARRAYS, *_CALL_ARRAYS, "dropped_call")
        if self.schema_version >= 2:
            spans["sample"] = (row["sample_offset"], row["n_samples"])
            names += _SAMPLE_ARRAYS
        cols = {}
        for name in names:
            lo, count = spans[SPECS[name].dim]
            cols[name] = self._rows(name, int(lo), int(lo) + int(count))
        return tree_from_columns(row, cols)

    def iter_trees(self, start: int = 0, stop: int | None = None) -> Iterator[Tree]:
        for i in range(start, len(self) if stop is None else min(stop, len(self))):
            yield self.read(i)

    def __iter__(self) -> Iterator[Tree]:
        return self.iter_trees()

    def stream(self, start: int = 0, poll_s: float = 0.5, timeout_s: float | None = None) -> Iterator[Tree]:
        """Yield committed trees from ``start`` on as they land, across processes (the
        trainer's view of the controller's writes). Ends once the writer has closed the
        store and every tree is yielded, or after ``timeout_s`` without a new tree."""
        if poll_s <= 0:
            raise ValueError(f"stream poll_s={poll_s}: must be > 0")
        i = start
        last_new = time.monotonic()
        while True:
            self.refresh()
            while i < len(self):
                yield self.read(i)
                i += 1
                last_new = time.monotonic()
            if self._marker.closed:
                return
            if timeout_s is not None and time.monotonic() - last_new >= timeout_s:
                return
            time.sleep(poll_s)

    def run_ids(self) -> list[str]:
        """Committed run ids in order: a relaunched controller skips runs already stored."""
        return [str(x) for x in self._rows("run_id", 0, len(self)).tolist()]

    def dataset(self):
        """The committed rows as a lazy xarray Dataset, even on a live or crashed store.

        A plain ``xarray.open_zarr`` works on a store at rest, but while an append is in
        flight (or after a writer died mid-append) arrays on one dim can differ in length,
        which xarray refuses ("conflicting sizes for dimension"). Then each array is opened
        on its own and cut to the commit.
        """
        import xarray as xr

        cut = {d: slice(0, n) for d, n in self._marker.lengths.items()}
        try:
            ds = xr.open_zarr(self.root, consolidated=False)
            return ds.isel({d: cut[d] for d in ds.dims})
        except ValueError:
            names = [s.name for s in self._specs]
            parts = [
                xr.open_zarr(self.root, consolidated=False, drop_variables=[n for n in names if n != spec.name])
                .isel({spec.dim: cut[spec.dim]})
                for spec in self._specs
            ]
            return xr.merge(parts, combine_attrs="override", join="exact")

    def verify(self) -> VerifyReport:
        """Read back every committed chunk and check it; raises ``ChunkCorruptError`` naming
        each bad (array, chunk index, file), else says how much was checked."""
        problems: list[CorruptChunk] = []
        chunks = 0
        for spec in self._specs:
            for k in range(len(self._marker.checksums[spec.name])):
                chunks += 1
                try:
                    self._chunk(spec.name, k, cache=False)
                except ChunkCorruptError as exc:
                    problems.extend(exc.corrupt)
        if problems:
            raise ChunkCorruptError(problems)
        return VerifyReport(chunks, dict(self._marker.lengths), self._marker.generation)

    def _rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        spec = SPECS[name]
        if hi <= lo:
            return np.zeros(0, dtype=object if spec.dtype == "str" else spec.dtype)
        chunk = self._marker.chunks[spec.dim]
        parts = []
        for k in range(lo // chunk, (hi - 1) // chunk + 1):
            values = self._chunk(name, k)
            base = k * chunk
            parts.append(values[max(lo - base, 0):hi - base])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _chunk(self, name: str, k: int, cache: bool = True) -> np.ndarray:
        """Committed values of chunk ``k``, checked against the commit marker."""
        spec = SPECS[name]
        chunk = self._marker.chunks[spec.dim]
        lo, hi = k * chunk, min((k + 1) * chunk, self._marker.lengths[spec.dim])
        lru = self._cache[name]
        hit = lru.get(k)
        if cache and hit is not None and hit.shape[0] >= hi - lo:
            lru.move_to_end(k)
            return hit[:hi - lo]
        path = str(self.root / name / "c" / str(k))
        arr = self._arrays[name]
        if arr.shape[0] < hi:       # a reader's metadata predates the commit it now trusts
            arr = self._arrays[name] = _array(self._group, name)
        try:
            values = arr[lo:hi]
        except Exception as exc:    # crc32c mismatch, undecodable bytes, truncated file
            raise ChunkCorruptError([CorruptChunk(name, k, path, f"unreadable: {exc}")]) from exc
        if spec.dtype == "str":
            values = np.asarray(values.tolist(), dtype=object)
        if not os.path.exists(path):
            raise ChunkCorruptError([CorruptChunk(name, k, path, "chunk file missing (Zarr would read fill values)")])
        if chunk_checksum(values, spec) != self._marker.checksums[name][k]:
            raise ChunkCorruptError([CorruptChunk(name, k, path, "values differ from the commit marker's checksum")])
        if cache:
            lru[k] = values
            lru.move_to_end(k)
            while len(lru) > _CACHE_PER_ARRAY:
                lru.popitem(last=False)
        return values


# ---- helpers: writing, creation, group checks, locking ----------------------------------

def _array(group: zarr.Group, name: str) -> zarr.Array:
    """Every committed chunk gets a file, even one of all fill values: then a missing chunk
    file is always damage, and Zarr skips comparing each chunk to the fill value (which cost
    a third of an append)."""
    return group[name].with_config({"write_empty_chunks": True})


async def _write_all(arrays: dict[str, zarr.Array], old: CommitMarker, new: CommitMarker,
                     columns: dict[str, np.ndarray], added: dict[str, int]) -> None:
    """Grow and fill every array concurrently: one event-loop round trip instead of ~56,
    which is most of an append's time for Zarr's small per-call overheads."""
    await asyncio.gather(*(
        arrays[s.name].async_array.resize((new.lengths[s.dim],))
        for s in ARRAYS if arrays[s.name].shape[0] != new.lengths[s.dim]))
    writes = []
    for spec in ARRAYS:
        if added[spec.dim]:
            values = columns[spec.name]
            if spec.dtype == "str":
                values = values.astype(np.dtypes.StringDType())
            sel = slice(old.lengths[spec.dim], new.lengths[spec.dim])
            writes.append(arrays[spec.name].async_array.setitem(sel, values))
    await asyncio.gather(*writes)


def _codecs(layout: StoreLayout) -> list:
    crc = Crc32cCodec()
    return [ZstdCodec(level=layout.zstd_level), crc] if layout.zstd_level else [crc]


def _create(root: Path, layout: StoreLayout, durable: bool) -> None:
    """Build the empty store beside ``root`` and rename it into place, so a crash during
    creation never leaves a half-made store at ``root``."""
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = root.parent / f".{root.name}.creating-{uuid.uuid4().hex}"
    try:
        attrs = {ATTR_KEY: {
            "schema_version": SCHEMA_VERSION, "layout": layout.to_json(), "commit_marker": f"{CONTROL_DIR}/{MARKER_NAME}",
            "dims": list(DIMS), "note": f"trust only the rows {CONTROL_DIR}/{MARKER_NAME} commits",
        }}
        group = zarr.open_group(LocalStore(tmp), mode="w-", zarr_format=3, attributes=attrs)
        group.create_group(CONTROL_DIR, attributes={"description": f"{MARKER_NAME}: the rows readers may trust"})
        for spec in ARRAYS:
            arr_attrs = {"description": spec.doc}
            if spec.codes:
                arr_attrs["codes"] = list(spec.codes)
            group.create_array(
                spec.name, shape=(0,), dtype=str if spec.dtype == "str" else spec.dtype,
                chunks=(layout.chunk(spec.dim),), compressors=_codecs(layout),
                dimension_names=[spec.dim], attributes=arr_attrs,
                chunk_key_encoding={"name": "default", "separator": "/"},
                fill_value="" if spec.dtype == "str" else 0,
            )
        write_marker(tmp, CommitMarker.empty({d: layout.chunk(d) for d in DIMS}), durable=durable)
        try:
            fsio.publish_dir(tmp, root, durable=durable)
        except OSError:
            if not (marker_path(root)).exists():   # not another writer's fresh store
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _open_group(root: Path, writable: bool) -> tuple[zarr.Group, StoreLayout, int]:
    meta = root / "zarr.json"
    if not root.exists():
        raise StoreError(f"{root} does not exist: no tree store there")
    if not meta.is_file():
        raise StoreError(f"{meta} is missing: {root} is not a Zarr v3 group, so not a tree store")
    try:
        group = zarr.open_group(LocalStore(root, read_only=not writable), mode="r+" if writable else "r",
                                zarr_format=3)
    except Exception as exc:
        raise StoreError(f"{meta}: cannot open as a Zarr v3 group: {exc}") from exc
    info = group.attrs.get(ATTR_KEY)
    if not isinstance(info, dict):
        raise StoreError(f"{meta}: not a gyre tree store (no {ATTR_KEY!r} attribute)")
    version = info.get("schema_version")
    if version not in READ_VERSIONS:
        raise StoreError(f"{meta}: schema_version {version!r}, this code reads versions "
                         f"{', '.join(map(str, READ_VERSIONS))}")
    if writable and version != SCHEMA_VERSION:
        raise StoreError(f"{meta}: a schema {version} store is read-only to this code, which appends schema "
                         f"{SCHEMA_VERSION} (per-sample behaviour logprobs); open it with mode='r', or start a new store")
    try:
        layout = StoreLayout.from_json(info.get("layout"), str(meta))
    except (ValueError, TypeError) as exc:
        raise StoreError(str(exc)) from None
    for spec in arrays_of(version):
        if not (root / spec.name / "zarr.json").is_file():
            raise StoreError(f"{root / spec.name / 'zarr.json'} is missing: array {spec.name!r} of schema {version}")
        try:
            arr = group[spec.name]
        except Exception as exc:
            raise StoreError(f"{root / spec.name / 'zarr.json'}: cannot open array {spec.name!r}: {exc}") from exc
        if tuple(arr.metadata.dimension_names or ()) != (spec.dim,) or arr.chunks != (layout.chunk(spec.dim),):
            raise StoreError(
                f"{root / spec.name / 'zarr.json'}: array {spec.name!r} has dims {arr.metadata.dimension_names} and "
                f"chunks {arr.chunks}, schema says ({spec.dim!r},) in chunks of {layout.chunk(spec.dim)}")
    return group, layout, version


def _check_marker_fits(root: Path, marker: CommitMarker, layout: StoreLayout) -> None:
    for d in marker.chunks:
        if marker.chunks[d] != layout.chunk(d):
            raise StoreError(f"{marker_path(root)}: chunks.{d}={marker.chunks[d]} but the store's layout has {layout.chunk(d)}")


def _lock_writer(root: Path) -> int:
    path = root / CONTROL_DIR / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreError(f"{path}: another process is writing this store (one writer at a time)") from None
    return fd

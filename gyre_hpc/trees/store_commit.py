"""The commit marker: the one file that says which rows of ``trees.zarr`` readers may trust.

Why a separate ``commit.json`` instead of group attributes: the writer must be able to
publish "these rows are complete" with one atomic step *after* every chunk is on disk. The
marker is replaced whole (``fsio.write_bytes``), so a reader (or a writer relaunched after a
crash) sees either the previous commit or the new one, never a mixture. Rows beyond the
marker's lengths are invisible and get truncated on the next open for writing.

It also carries a crc32c per chunk of every array, taken over the *committed values* of
that chunk (``store_schema.canonical_bytes``). Values, not stored bytes: the trailing
chunk's file is legitimately rewritten by the next append, but its committed prefix must
not change, and a chunk file that went missing (which Zarr would silently read as fill
values) is caught too. Zarr's own crc32c codec on each chunk catches flipped bits in the
stored bytes before decompression.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import crc32c
import numpy as np

from gyre_hpc import fsio
from gyre_hpc.trees.store_schema import (
    READ_VERSIONS, SCHEMA_VERSION, ArraySpec, arrays_of, canonical_bytes, dims_of,
)

# The marker (and the writer's lock) live in an empty Zarr subgroup, so Zarr and xarray,
# listing the root group, meet only Zarr nodes instead of warning about unknown files.
CONTROL_DIR = "control"
MARKER_NAME = "commit.json"


def marker_path(root: Path) -> Path:
    return root / CONTROL_DIR / MARKER_NAME


class StoreError(Exception):
    """A tree store that cannot be opened or written as asked; the message names the file."""


@dataclass(frozen=True)
class CorruptChunk:
    array: str
    chunk: int
    path: str
    reason: str

    def __str__(self) -> str:
        return f"array {self.array!r} chunk {self.chunk} ({self.path}): {self.reason}"


class ChunkCorruptError(StoreError):
    """Committed data that does not read back as it was committed.

    ``array``/``chunk``/``path`` name the first bad chunk; ``corrupt`` lists every one found.
    """

    def __init__(self, corrupt: list[CorruptChunk]):
        self.corrupt = tuple(corrupt)
        first = self.corrupt[0]
        self.array, self.chunk, self.path = first.array, first.chunk, first.path
        more = "" if len(self.corrupt) == 1 else f" (and {len(self.corrupt) - 1} more chunks)"
        listing = "\n  ".join(str(c) for c in self.corrupt[:20])
        super().__init__(f"corrupt chunk{'s' if len(self.corrupt) > 1 else ''}{more}:\n  {listing}")


@dataclass(frozen=True)
class CommitMarker:
    """What a reader may trust: rows per dim and a crc32c per chunk of each array."""

    schema_version: int
    generation: int                       # bumped by every commit; readers poll it
    lengths: dict[str, int]               # dim -> committed rows
    chunks: dict[str, int]                # dim -> chunk size (elements)
    checksums: dict[str, list[int]]       # array -> crc32c per chunk of committed values
    closed: bool = False                  # the writer closed cleanly; streams may stop
    time: float = field(default_factory=time.time)

    @property
    def n_trees(self) -> int:
        return self.lengths["tree"]

    @classmethod
    def empty(cls, chunks: dict[str, int]) -> "CommitMarker":
        return cls(SCHEMA_VERSION, 0, {d: 0 for d in dims_of(SCHEMA_VERSION)}, dict(chunks),
                   {s.name: [] for s in arrays_of(SCHEMA_VERSION)})

    def extended(self, columns: dict[str, np.ndarray], closed: bool = False) -> "CommitMarker":
        """The marker after appending ``columns`` (one array per name, rows per dim)."""
        lengths = dict(self.lengths)
        checksums = {}
        for spec in arrays_of(self.schema_version):
            values = columns[spec.name]
            checksums[spec.name] = extend_checksums(
                self.checksums[spec.name], self.lengths[spec.dim], values, self.chunks[spec.dim], spec)
            lengths[spec.dim] = self.lengths[spec.dim] + int(values.shape[0])
        return CommitMarker(self.schema_version, self.generation + 1, lengths, dict(self.chunks),
                            checksums, closed)

    def with_closed(self, closed: bool) -> "CommitMarker":
        return replace(self, generation=self.generation + 1, closed=closed, time=time.time())

    def to_json(self) -> dict:
        return {"schema_version": self.schema_version, "generation": self.generation,
                "lengths": self.lengths, "chunks": self.chunks, "closed": self.closed,
                "time": self.time, "checksums": self.checksums}


def extend_checksums(crcs: list[int], old_len: int, values: np.ndarray, chunk: int, spec: ArraySpec) -> list[int]:
    """Per-chunk crc32c after appending ``values`` at row ``old_len``, without rereading
    the committed prefix: crc32c continues over concatenated bytes."""
    out = list(crcs)
    pos, i, n = old_len, 0, int(values.shape[0])
    while i < n:
        k, within = divmod(pos, chunk)
        take = min(chunk - within, n - i)
        piece = canonical_bytes(values[i:i + take], spec)
        if within == 0:
            out.append(crc32c.crc32c(piece))
        else:
            out[k] = crc32c.crc32c(piece, out[k])
        pos += take
        i += take
    return out


def chunk_checksum(values: np.ndarray, spec: ArraySpec) -> int:
    return crc32c.crc32c(canonical_bytes(values, spec))


def write_marker(root: Path, marker: CommitMarker, durable: bool = True) -> None:
    """Publish ``marker``: readers see the previous commit or this one, never a mixture."""
    data = json.dumps(marker.to_json(), separators=(",", ":")).encode()
    fsio.write_bytes(marker_path(root), data, durable=durable)


def read_marker(root: Path) -> CommitMarker:
    """Load and check ``commit.json``; anything malformed is a StoreError naming the file."""
    path = marker_path(root)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{path} is missing: {root} is not a committed tree store") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path} is not valid JSON ({exc}); the commit marker is damaged") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version not in READ_VERSIONS:
        raise StoreError(f"{path}: schema_version {version!r}, this code reads versions "
                         f"{', '.join(map(str, READ_VERSIONS))}")
    dims, arrays = dims_of(version), arrays_of(version)
    try:
        marker = CommitMarker(
            schema_version=int(version),
            generation=int(data["generation"]),
            lengths={d: int(data["lengths"][d]) for d in dims},
            chunks={d: int(data["chunks"][d]) for d in dims},
            checksums={s.name: [int(x) for x in data["checksums"][s.name]] for s in arrays},
            closed=bool(data.get("closed", False)),
            time=float(data.get("time", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise StoreError(f"{path}: malformed commit marker, missing or bad field {exc}") from None
    for spec in arrays:
        n, chunk = marker.lengths[spec.dim], marker.chunks[spec.dim]
        expect = -(-n // chunk) if chunk > 0 else -1
        if len(marker.checksums[spec.name]) != expect:
            raise StoreError(
                f"{path}: checksums.{spec.name} has {len(marker.checksums[spec.name])} entries, "
                f"{n} rows in chunks of {chunk} need {expect}")
    return marker

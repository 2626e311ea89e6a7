"""Moving a torch state dict between ranks over MPI, in bounded chunks.

Why chunks: a state dict can exceed 2 GB, past what one MPI message count (a C int) can
describe in many MPI builds, and one giant message needs a second full-size staging copy.
So the bytes of all tensors are treated as one stream cut into ``chunk_bytes`` pieces: a
chunk that lies inside one tensor is broadcast straight from (into) that tensor's memory;
only chunks spanning several small tensors go through a staging buffer. A small pickled
header (names, dtypes, shapes) goes first so receivers can allocate, or check that the
tensors they already hold match and receive in place.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI
from torch.autograd.graph import increment_version

DEFAULT_CHUNK_BYTES = 32 << 20
# Pieces at least this big are sent in place rather than packed with their neighbours.
DIRECT_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str      # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Piece:
    """Bytes ``start:stop`` of tensor ``index`` inside one chunk."""

    index: int
    start: int
    stop: int


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    chunks: int
    seconds: float


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight header names dtype {name!r}, which this torch does not have")
    return dtype


def describe(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
            for name, t in state.items()]


def plan_chunks(specs: list[TensorSpec], chunk_bytes: int) -> list[list[Piece]]:
    """Cut the concatenated bytes of all tensors into chunks of at most ``chunk_bytes``."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be at least 1")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    room = chunk_bytes
    for i, spec in enumerate(specs):
        pos = 0
        while pos < spec.nbytes:
            take = min(room, spec.nbytes - pos)
            current.append(Piece(i, pos, pos + take))
            pos += take
            room -= take
            if room == 0:
                chunks.append(current)
                current, room = [], chunk_bytes
    if current:
        chunks.append(current)
    return chunks


def _byte_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's own memory as flat uint8 (no copy); numpy has no bfloat16, uint8 is universal."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _as_sendable(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def bcast_state_dict(state: dict[str, torch.Tensor] | None, comm: MPI.Intracomm, root: int = 0,
                     into: dict[str, torch.Tensor] | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     agreed: list[TensorSpec] | None = None) -> tuple[dict[str, torch.Tensor], TransferStats]:
    """Broadcast ``state`` from ``root`` to every rank of ``comm``; every rank gets the dict back.

    Receivers may pass ``into``: tensors with the same names, dtypes and shapes (e.g. a
    model's own ``state_dict()``), which are overwritten in place so no second copy of the
    weights is allocated. A mismatch is an error naming the tensor, never a silent reshape.
    ``agreed``: the header every rank already holds from an earlier broadcast (all ranks
    pass the same, with the same ``chunk_bytes``); the header round is then skipped.
    """
    import time

    t0 = time.perf_counter()
    is_root = comm.Get_rank() == root
    if is_root:
        if state is None:
            raise ValueError("bcast_state_dict: the root rank must pass the state dict")
        tensors = [_as_sendable(t) for t in state.values()]
        specs = describe(dict(zip(state.keys(), tensors)))
        if agreed is not None and specs != agreed:
            raise ValueError("bcast_state_dict: the state dict differs from the agreed header; broadcast the header")
        header = (specs, chunk_bytes)
    else:
        header = None
    specs, chunk_bytes = (agreed, chunk_bytes) if agreed is not None else comm.bcast(header, root=root)
    if not is_root:
        tensors = _receive_buffers(specs, into)
    views = [_byte_view(t) for t in tensors]
    chunks = plan_chunks(specs, chunk_bytes)
    staging = None
    for pieces in chunks:
        # Large pieces go straight from/into tensor memory; only small ones are packed, so
        # the staging buffer stays small and no chunk is copied twice.
        direct = [p for p in pieces if p.stop - p.start >= DIRECT_MIN_BYTES or len(pieces) == 1]
        packed = [p for p in pieces if p not in direct]
        for p in direct:
            comm.Bcast([views[p.index][p.start:p.stop], MPI.BYTE], root=root)
        if not packed:
            continue
        size = sum(p.stop - p.start for p in packed)
        if staging is None or staging.size < size:
            staging = np.empty(size, dtype=np.uint8)
        buf = staging[:size]
        if is_root:
            pos = 0
            for p in packed:
                buf[pos:pos + p.stop - p.start] = views[p.index][p.start:p.stop]
                pos += p.stop - p.start
        comm.Bcast([buf, MPI.BYTE], root=root)
        if not is_root:
            pos = 0
            for p in packed:
                views[p.index][p.start:p.stop] = buf[pos:pos + p.stop - p.start]
                pos += p.stop - p.start
    if not is_root:
        # MPI wrote the bytes behind torch's back: bump each tensor's version as an in-place
        # op would, or what is kept for a weight while it is unchanged (the invariant
        # kernels' W^T, ``models.invariant._Kept``) would go on serving the old weights.
        for t in tensors:
            increment_version(t)
    if not is_root and into is not None:
        for s, t in zip(specs, tensors):
            target = into[s.name]
            if target.data_ptr() != t.data_ptr() or target.device != t.device:
                target.detach().copy_(t)
        tensors = [into[s.name] for s in specs]
    out = dict(zip((s.name for s in specs), tensors))
    total = sum(s.nbytes for s in specs)
    return out, TransferStats(bytes=total, chunks=len(chunks), seconds=time.perf_counter() - t0)


def bcast_into(state: dict[str, torch.Tensor], comm: MPI.Intracomm,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TransferStats:
    """Make every rank's ``state`` (a model's own tensors: the same names, dtypes and shapes on
    each rank) equal to the one of ``comm``'s rank 0, received in place (no second copy):
    how a cell joining, a cell's other ranks and a weights-only replica take the weights."""
    root = comm.Get_rank() == 0
    _, stats = bcast_state_dict(state if root else None, comm, root=0, into=None if root else state,
                                chunk_bytes=chunk_bytes)
    return stats


def _receive_buffers(specs: list[TensorSpec], into: dict[str, torch.Tensor] | None) -> list[torch.Tensor]:
    if into is None:
        return [torch.empty(s.shape, dtype=dtype_from_name(s.dtype)) for s in specs]
    missing = [s.name for s in specs if s.name not in into]
    extra = [n for n in into if n not in {s.name for s in specs}]
    if missing or extra:
        raise ValueError(f"received state dict does not match the local one: missing locally {missing}, "
                         f"not sent {extra}")
    out = []
    for s in specs:
        t = into[s.name]
        if dtype_name(t.dtype) != s.dtype or tuple(t.shape) != s.shape:
            raise ValueError(f"tensor {s.name}: sender has {s.dtype}{list(s.shape)}, "
                             f"receiver {dtype_name(t.dtype)}{list(t.shape)}")
        if t.device.type != "cpu" or not t.is_contiguous():
            # MPI here is not assumed CUDA-aware: land the bytes on the host, copy over after.
            out.append(torch.empty(s.shape, dtype=t.dtype))
        else:
            out.append(t.detach())
    return out


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """CRC32 over names, dtypes, shapes and bytes: equal iff bit-for-bit equal (for tests and logs)."""
    crc = 0
    for name, t in state.items():
        t = _as_sendable(t)
        crc = zlib.crc32(f"{name}:{dtype_name(t.dtype)}:{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(memoryview(_byte_view(t)), crc)
    return f"{crc:08x}"


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


TAG_WEIGHTS_COMM = 103
ENGINE_CHUNK_BYTES = 1 << 30


class WeightsChannel:
    """The core cell's new weights to the serving engines after each optimizer step.

    The same chunked broadcast as a flip (``bcast_state_dict``): from the core leader
    straight into each engine's own tensors, never pickled and never through the controller,
    so any size goes (chunks stay below the MPI count limit). Members are the core leader
    (root) and the engines' ranks; the communicator is built once per member set
    (``Create_group``, members only) and kept, because the set rarely changes between steps.
    Both sides hold one channel on the same parent communicator. Chunks are 1 GiB by
    default, half the count limit: every chunk is a separate Bcast whose tree latency does not
    overlap the next, so at 32 MB (the flips' size) 100 MB reached ~0.76 of one raw Bcast.
    """

    def __init__(self, parent: MPI.Intracomm, chunk_bytes: int = ENGINE_CHUNK_BYTES):
        self.parent = parent
        self.chunk_bytes = chunk_bytes
        self._comms: dict[tuple[int, ...], MPI.Intracomm] = {}
        # members -> the header (names, dtypes, shapes) the first push to them carried. The
        # model's tensors keep their shapes for the whole run, so later pushes skip the header
        # round: one collective less per step, which on a loaded machine is a scheduling
        # latency against a transfer of tens of ms (bench switch: sync vs one raw Bcast).
        self._agreed: dict[tuple[int, ...], list[TensorSpec]] = {}

    def _comm(self, members: tuple[int, ...]) -> MPI.Intracomm:
        if members not in self._comms:
            world_group = self.parent.Get_group()
            group = world_group.Incl(list(members))
            try:
                self._comms[members] = self.parent.Create_group(group, TAG_WEIGHTS_COMM)
            finally:
                group.Free()
                world_group.Free()
        return self._comms[members]

    def push(self, state: dict[str, torch.Tensor], members: tuple[int, ...]) -> TransferStats:
        """Root side (``members[0]`` must be this rank)."""
        if self.parent.Get_rank() != members[0]:
            raise ValueError(f"WeightsChannel.push on rank {self.parent.Get_rank()}: the root is {members[0]}")
        known = self._agreed.get(members)
        if known is not None and describe({k: _as_sendable(t) for k, t in state.items()}) != known:
            # Receivers would skip the header and wait for data laid out the old way.
            raise ValueError(f"WeightsChannel.push to {members}: the state dict's names, dtypes or shapes changed "
                             f"since the first push; a channel carries one model")
        _, stats = bcast_state_dict(state, self._comm(members), root=0, chunk_bytes=self.chunk_bytes, agreed=known)
        if known is None:
            self._agreed[members] = describe({k: _as_sendable(t) for k, t in state.items()})
        return stats

    def receive(self, into: dict[str, torch.Tensor], members: tuple[int, ...]) -> TransferStats:
        """Engine side: overwrite ``into`` (the engine's own tensors) in place."""
        known = self._agreed.get(members)
        got, stats = bcast_state_dict(None, self._comm(members), root=0, into=into, chunk_bytes=self.chunk_bytes,
                                      agreed=known)
        if known is None:
            self._agreed[members] = describe(got)     # in the sender's order, as the header had it
        return stats

    def close(self) -> None:
        for comm in self._comms.values():
            comm.Free()
        self._comms.clear()
        self._agreed.clear()

"""Moving a KVState between ranks: a pickled header, then the cache as raw byte chunks.

Why this shape: the header (request, tokens, generator state: a few KB) pickles cheaply;
the cache (1 KB per token on the tiny model, up to GBs on a real one) must not be pickled,
so each tensor goes as buffer-mode ``Isend`` chunks straight from the engine's memory
(token-major cache prefixes are contiguous) into tensors the receiver allocates from the
header. Chunks bound the size of any one message, so a large cache neither needs one
giant contiguous MPI message nor stalls eager-protocol buffers, and the MPI library can
pipeline them (over RDMA where it uses RDMA). Messages between one pair of ranks on one
tag arrive in order, so a sender may stream several states back to back.

A header of ``None`` says "this request is gone" (it finished between the plan and the
export), so a receiver expecting it is never left waiting.

Use a communicator dedicated to engine traffic (``comm.Dup()``) so these tags cannot
meet another part's messages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gyre_hpc.engines.kv_state import KVState, alloc_wire, from_wire, to_wire

KV_HEADER_TAG = 7101
KV_DATA_TAG = 7102
DEFAULT_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class TransferStats:
    request_id: str | None
    bytes: int
    seconds: float


def _byte_view(t: torch.Tensor):
    """numpy uint8 view of a contiguous CPU tensor of any dtype (bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def send_kv_state(comm, state: KVState | None, dest: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TransferStats:
    """Send one state (or the "gone" marker None) to ``dest``; returns when the buffers are free."""
    from mpi4py import MPI

    if chunk_bytes < 1:
        raise ValueError(f"send_kv_state: chunk_bytes={chunk_bytes} must be >= 1")
    t0 = time.perf_counter()
    if state is None:
        comm.send(None, dest=dest, tag=KV_HEADER_TAG)
        return TransferStats(None, 0, time.perf_counter() - t0)
    header, tensors = to_wire(state)
    header["chunk_bytes"] = chunk_bytes
    comm.send(header, dest=dest, tag=KV_HEADER_TAG)
    requests, total = [], 0
    for t in tensors:
        # GPU caches are staged through host memory: CUDA-aware MPI is not assumed.
        buf = _byte_view(t.detach().to("cpu").contiguous())
        total += buf.size
        for off in range(0, buf.size, chunk_bytes):
            requests.append(comm.Isend([buf[off:off + chunk_bytes], MPI.BYTE], dest=dest, tag=KV_DATA_TAG))
    MPI.Request.Waitall(requests)
    return TransferStats(state.request_id, total, time.perf_counter() - t0)


def recv_kv_state(comm, source: int) -> tuple[KVState | None, TransferStats]:
    """Receive one state sent by ``send_kv_state`` from ``source`` (None: the request is gone)."""
    from mpi4py import MPI

    t0 = time.perf_counter()
    header = comm.recv(source=source, tag=KV_HEADER_TAG)
    if header is None:
        return None, TransferStats(None, 0, time.perf_counter() - t0)
    chunk = header.pop("chunk_bytes")
    tensors = alloc_wire(header)
    requests, total = [], 0
    for t in tensors:
        buf = _byte_view(t)
        total += buf.size
        for off in range(0, buf.size, chunk):
            requests.append(comm.Irecv([buf[off:off + chunk], MPI.BYTE], source=source, tag=KV_DATA_TAG))
    MPI.Request.Waitall(requests)
    state = from_wire(header, tensors)
    return state, TransferStats(state.request_id, total, time.perf_counter() - t0)


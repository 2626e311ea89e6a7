"""Averaging gradients over the training communicator, bucket by bucket.

Why buckets of flattened tensors: one Allreduce per parameter pays the latency once per
tensor (hundreds of them), one Allreduce of everything needs a full-size copy; a few
buffer-based Allreduces of ~25 MB flattened buckets sit between. Low-precision gradients are
reduced in float32 (MPI has no bfloat16 sum, and summing many replicas in bf16 loses bits).

The average is weighted: each replica says how much data its gradient stands for (tokens,
micro-batches) and the result is ``sum(w_i * g_i) / sum(w_i)``, so replicas that did
unequal shares of a step still give the gradient of the whole step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI

DEFAULT_BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class SyncStats:
    total_weight: float
    buckets: int
    bytes: int


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def buckets_of(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets of one reduce dtype, each at most ``bucket_bytes``
    (a single larger tensor gets a bucket to itself)."""
    out: list[list[int]] = []
    open_by_dtype: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        dt = _reduce_dtype(t.dtype)
        size = t.numel() * torch.finfo(dt).bits // 8
        idxs, used = open_by_dtype.get(dt, ([], 0))
        if idxs and used + size > bucket_bytes:
            out.append(idxs)
            idxs, used = [], 0
        idxs.append(i)
        open_by_dtype[dt] = (idxs, used + size)
    out.extend(idxs for idxs, _ in open_by_dtype.values() if idxs)
    return out


def allreduce_mean(tensors: list[torch.Tensor], comm: MPI.Intracomm, weight: float = 1.0,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> SyncStats:
    """Replace each tensor, in place, by the weighted mean of that tensor over ``comm``.

    Every rank must pass tensors of the same shapes in the same order. A rank with weight 0
    (no data this step) still takes part and receives the mean.
    """
    total = comm.allreduce(float(weight), op=MPI.SUM)
    if total <= 0:
        raise ValueError(f"allreduce_mean: the weights over the training communicator sum to {total}; "
                         "no replica reported any data")
    moved = 0
    groups = buckets_of(tensors, bucket_bytes)
    for idxs in groups:
        dt = _reduce_dtype(tensors[idxs[0]].dtype)
        flat = torch.cat([tensors[i].detach().to("cpu", dt).reshape(-1) for i in idxs])
        if weight != 1.0:
            flat.mul_(weight)
        buf = flat.numpy()
        comm.Allreduce(MPI.IN_PLACE, [buf, MPI.DOUBLE if dt == torch.float64 else MPI.FLOAT], op=MPI.SUM)
        flat.div_(total)
        moved += buf.nbytes
        pos = 0
        for i in idxs:
            t = tensors[i]
            n = t.numel()
            t.detach().copy_(flat[pos:pos + n].view(t.shape))
            pos += n
    return SyncStats(total_weight=total, buckets=len(groups), bytes=moved)



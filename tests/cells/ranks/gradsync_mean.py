"""Rank program: each rank holds different gradients (float32, bfloat16, float64) and a
weight; after allreduce_mean every rank compares with the weighted mean it computes itself
in float64 from every rank's (reproducible) gradients."""
import json
import sys

import torch
from mpi4py import MPI

from gyre_hpc.cells import gradsync

out_path, bucket_bytes = sys.argv[1], int(sys.argv[2])
world = MPI.COMM_WORLD
SHAPES = [((5, 3), torch.float32), ((33,), torch.bfloat16), ((4, 4, 2), torch.float64), ((1000,), torch.float32)]


def grads_of(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(s, generator=g, dtype=torch.float64) * (rank + 1)).to(dt) for s, dt in SHAPES]


def weight_of(rank: int) -> float:
    return float(rank % 3)   # rank 0 has weight 0: takes part, contributes nothing


rank, size = world.Get_rank(), world.Get_size()
mine = grads_of(rank)
stats = gradsync.allreduce_mean(mine, world, weight=weight_of(rank), bucket_bytes=bucket_bytes)
total = sum(weight_of(r) for r in range(size))
errors = []
for i, (shape, dtype) in enumerate(SHAPES):
    expected = sum(grads_of(r)[i].double() * weight_of(r) for r in range(size)) / total
    # bf16 results are rounded to 8 significant bits on the way back; float32 to ~7 digits.
    tol = (2.0**-7 if dtype == torch.bfloat16 else 1e-6) * float(expected.abs().max())
    err = float((mine[i].double() - expected).abs().max())
    errors.append({"dtype": str(dtype), "shape": list(shape), "max_err": err, "tol": tol,
                   "kept_dtype": mine[i].dtype == dtype})
results = world.gather({"rank": rank, "errors": errors, "buckets": stats.buckets,
                        "total_weight": stats.total_weight}, root=0)
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(results, f)

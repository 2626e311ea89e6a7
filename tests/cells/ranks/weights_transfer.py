"""Rank program: broadcast an odd state dict (dtypes, sizes, empty and 0-d tensors) in tiny
chunks from rank 0; every rank writes its received tensors' checksums and raw bytes. Then
``bcast_into`` makes every rank's own tensors rank 0's."""
import json
import sys

import torch
from mpi4py import MPI

from gyre_hpc.cells import weights

out_path, chunk_sizes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
world = MPI.COMM_WORLD


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w.f32": torch.randn(7, 13, generator=g),
        "w.bf16": torch.randn(3, 5, 11, generator=g).to(torch.bfloat16),
        "idx.i64": torch.randint(-2**40, 2**40, (17,), generator=g, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "big.f32": torch.randn(4099, generator=g),   # several chunks on its own
        "mask": torch.rand(9, generator=g) > 0.5,
        "big2.f32": torch.randn(80_000, generator=g),  # sent in place even inside a shared chunk
    }


rank = world.Get_rank()
ref = reference()
all_results = []
for chunk_bytes in chunk_sizes:
    if rank == 0:
        got, stats = weights.bcast_state_dict(ref, world, chunk_bytes=chunk_bytes)
    elif rank == 1:
        # Receive in place into tensors of the right shape holding other values.
        into = {k: torch.zeros_like(v) for k, v in ref.items()}
        before = {k: t._version for k, t in into.items()}
        got, stats = weights.bcast_state_dict(None, world, into=into, chunk_bytes=chunk_bytes)
        assert all(got[k].data_ptr() == into[k].data_ptr() for k in ref if ref[k].numel()), "not received in place"
        # torch saw each tensor change, as after an in-place op (what is cached on a weight
        # while it is unchanged, such as models.invariant's W^T, is rebuilt)
        assert all(into[k]._version > before[k] for k in ref), {k: (before[k], into[k]._version) for k in ref}
    elif rank == 2:
        # A non-contiguous target (a transposed view, like a device tensor) is filled via a host buffer.
        into = {k: torch.zeros_like(v) for k, v in ref.items()}
        into["w.f32"] = torch.zeros(13, 7).t()
        got, stats = weights.bcast_state_dict(None, world, into=into, chunk_bytes=chunk_bytes)
        assert got["w.f32"] is into["w.f32"] and torch.equal(into["w.f32"], ref["w.f32"]), "view not filled"
    else:
        got, stats = weights.bcast_state_dict(None, world, chunk_bytes=chunk_bytes)
    result = {
        "rank": rank,
        "checksum": weights.state_checksum(got),
        "ref_checksum": weights.state_checksum(ref),
        "equal": all(torch.equal(got[k], ref[k]) and got[k].dtype == ref[k].dtype for k in ref),
        "names": list(got),
        "bytes": stats.bytes,
        "chunks": stats.chunks,
    }
    all_results.append(result)
# bcast_into: every rank's own tensors become rank 0's, in place (a joiner taking the weights).
mine = {k: v.clone() for k, v in ref.items()} if rank == 0 else {k: torch.zeros_like(v) for k, v in ref.items()}
ptrs = {k: t.data_ptr() for k, t in mine.items()}
weights.bcast_into(mine, world, chunk_bytes=chunk_sizes[0])
assert all(torch.equal(mine[k], ref[k]) and mine[k].data_ptr() == ptrs[k] for k in ref), "bcast_into: not rank 0's, in place"
results = world.gather(all_results, root=0)
if rank == 0:
    with open(out_path, "w") as f:
        json.dump(results, f)

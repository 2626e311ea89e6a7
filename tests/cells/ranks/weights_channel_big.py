"""Rank program: the engines' weight channel with a state dict over the 2 GiB MPI count limit.

``mpiexec -n 2 weights_channel_big.py OUT GIB``: rank 0 (the core leader) pushes a state dict
whose largest tensor alone exceeds 2**31 bytes; rank 1 (an engine) receives it into tensors
it already holds. Rank 1 writes whether every byte arrived, in place, and how long it took.
"""
import json
import sys

import torch
from mpi4py import MPI

from gyre_hpc.cells.weights import WeightsChannel, state_checksum

out, gib = sys.argv[1], float(sys.argv[2])
world = MPI.COMM_WORLD
n_big = int(gib * (1 << 30)) // 2


def fill(state):
    gen = torch.Generator().manual_seed(7)
    big = state["layers.0.weight"]
    # A pattern in every 1 MiB block plus random ends: cheap to make, any misplaced chunk shows.
    block = 1 << 19
    big.view(torch.int16)[::block] = torch.arange(0, (n_big + block - 1) // block, dtype=torch.int16)
    big[:4096] = torch.randn(4096, generator=gen).to(torch.bfloat16)
    big[-4096:] = torch.randn(4096, generator=gen).to(torch.bfloat16)
    state["layers.0.bias"].copy_(torch.randn(1000, generator=gen))
    state["step"].fill_(12345678901)


state = {"layers.0.weight": torch.zeros(n_big, dtype=torch.bfloat16),
         "layers.0.bias": torch.zeros(1000, dtype=torch.float32),
         "step": torch.zeros((), dtype=torch.int64)}
channel = WeightsChannel(world)
members = (0, 1)
if world.Get_rank() == 0:
    fill(state)
    stats = channel.push(state, members)
    world.send(state_checksum(state), dest=1)
else:
    ptrs = {k: v.data_ptr() for k, v in state.items()}
    stats = channel.receive(state, members)
    expected = world.recv(source=0)
    with open(out, "w") as f:
        json.dump({"bytes": stats.bytes, "chunks": stats.chunks, "seconds": stats.seconds,
                   "in_place": all(v.data_ptr() == ptrs[k] for k, v in state.items()),
                   "checksum_equal": state_checksum(state) == expected,
                   "big_bytes": state["layers.0.weight"].numel() * 2}, f)
channel.close()

"""Rank program: a WeightsChannel pushing the same model several times (the header goes once).

``mpiexec -n 3 weights_channel_repeat.py OUT``: rank 0 pushes a state dict 3 times with new
values each time; ranks 1 and 2 receive into their own tensors, held in another dict order.
Rank 1 writes whether every push arrived bit-exact and in place, then rank 0 tries a push
whose shapes changed (refused by name, before any collective).
"""
import json
import sys

import torch
from mpi4py import MPI

from gyre_hpc.cells.weights import WeightsChannel, state_checksum

out = sys.argv[1]
world = MPI.COMM_WORLD
rank = world.Get_rank()


def state(seed: int | None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    s = {"a.weight": torch.randn(300_000, generator=gen).to(torch.bfloat16),
         "b.bias": torch.randn(77, generator=gen), "c.weight": torch.randn(2, 70_000, generator=gen)}
    return s if seed is not None else {k: torch.zeros_like(v) for k, v in reversed(list(s.items()))}


channel = WeightsChannel(world)
members = (0, 1, 2)
mine = state(None)
ptrs = {k: v.data_ptr() for k, v in mine.items()}
report = {"exact": [], "in_place": []}
for push in range(3):
    if rank == 0:
        sent = state(100 + push)
        channel.push(sent, members)
        world.bcast(state_checksum(sent), root=0)
    else:
        channel.receive(mine, members)
        want = world.bcast(None, root=0)
        ordered = {k: mine[k] for k in ("a.weight", "b.bias", "c.weight")}
        report["exact"].append(state_checksum(ordered) == want)
        report["in_place"].append(all(v.data_ptr() == ptrs[k] for k, v in mine.items()))
if rank == 0:
    bad = state(1)
    bad["c.weight"] = torch.zeros(3, 70_000)
    try:
        channel.push(bad, members)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    world.send(refused, dest=1)
elif rank == 1:
    report["refused"] = world.recv(source=0)
    with open(out, "w") as f:
        json.dump(report, f)
channel.close()

"""Rank program: random role sequences; after each, train_comm is re-derived (alternately by
every world rank with Split, as at fleet start, and by its members only with Create_group, as
in a flip); rank 0 records what each rank's train_comm holds next to what the plan says."""
import json
import random
import sys

from mpi4py import MPI

from gyre_hpc.cells import comms
from gyre_hpc.cells.plan import plan_cells, train_ranks, with_roles
from gyre_hpc.config import CellPlan
from gyre_hpc.sched.state import CellKind, Role

out_path, count, rpc, n_flips = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
world = MPI.COMM_WORLD
plan = CellPlan(count=count, ranks_per_cell=rpc, core=1, rollout_only=[count - 1])
cells = plan_cells(plan)
rng = random.Random(7)  # same sequence on every rank
train = comms.split_train_comm(world, cells)
cell_comm = comms.split_cell_comm(world, cells)
records = []
for i in range(n_flips):
    elastic = [c.id for c in cells if c.kind is CellKind.ELASTIC]
    flips = {c: rng.choice([Role.TRAIN, Role.ROLLOUT]) for c in rng.sample(elastic, rng.randint(1, len(elastic)))}
    cells = with_roles(cells, flips)
    comms.free(train)
    train = comms.split_train_comm(world, cells) if i % 2 else comms.create_train_comm(world, cells)
    seen = comms.world_ranks_of(train, world) if train is not None else None
    # A collective over the new communicator proves it is usable, not only well-formed.
    total = train.allreduce(world.Get_rank()) if train is not None else None
    gathered = world.gather({"rank": world.Get_rank(), "members": seen, "sum": total}, root=0)
    if world.Get_rank() == 0:
        records.append({"expected": train_ranks(cells),
                        "train_cells": [c.id for c in cells if c.role is Role.TRAIN],
                        "seen": gathered})
cell_members = world.gather(comms.world_ranks_of(cell_comm, world) if cell_comm is not None else None, root=0)
if world.Get_rank() == 0:
    with open(out_path, "w") as f:
        json.dump({"records": records, "cell_members": cell_members,
                   "cells": [list(c.ranks) for c in cells]}, f)

"""Rank program: training cells of R ranks sharded with FSDP2 (gloo), C cells reducing over MPI.

``grad OUT PORT C R [DTYPE [checkpoint-layers]]``: one step of a 4-micro-batch batch (rank of cell c, shard k takes
micro-batch c*R+k... split evenly); rank 0 writes the loss and the gathered full gradient's
relative difference from one unsharded replica that trains the whole batch.

``save OUT PORT R ROOT``: steps 1-3 on one cell of R ranks, a sharded checkpoint after step 1;
writes each step's loss and the full state after step 1 (ROOT/full-1.pt).
``hf OUT PORT R ROOT``: one step on a cell of R ranks of a model with the embedded tokenizer's
vocabulary, then a sharded checkpoint with its tokenizer; rank 0 writes the whole model's
state after the step (ROOT/model-1.pt), what its export must give.
``load OUT PORT R ROOT``: a fresh cell of R ranks (other seed) loads ROOT's checkpoint, compares
its full state with ROOT/full-1.pt bitwise, then runs steps 2-3 and writes their losses.
"""
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from gyre_hpc.cells import sharding
from gyre_hpc.cells.checkpoint import CheckpointMeta
from gyre_hpc.models.decoder import LMConfig, build_model
from gyre_hpc.models.tokenizer import embedded_tokenizer

torch.set_num_threads(1)
# Sizes that do not divide 2 or 4 ranks evenly (vocab 101, kv projection 2*16=32 rows is even).
CFG = LMConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=90)
MICRO, ROWS, T = 4, 2, 12           # micro-batches in a step, rows in each, tokens in a row

mode, out_path, port = sys.argv[1], sys.argv[2], sys.argv[3]
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=size)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, CFG.vocab_size, (MICRO, ROWS, T), generator=g)


def loss_of(model, ids: torch.Tensor, checkpoint_layers: bool = False) -> torch.Tensor:
    """Mean next-token cross entropy over ids [B, T] (every row the same length)."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    logits = model(ids, pos, checkpoint_layers=checkpoint_layers)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def cell_groups(cells: int, ranks: int):
    """Every rank creates every cell's group (torch requires it) and keeps its own."""
    mine = None
    for c in range(cells):
        g = dist.new_group(list(range(c * ranks, (c + 1) * ranks)), backend="gloo")
        if rank // ranks == c:
            mine = g
    return mine


def my_micro(step: int, index: int, ranks_total: int) -> torch.Tensor:
    per = MICRO // ranks_total
    return batch(step)[index * per:(index + 1) * per].reshape(-1, T)


def full_state(model, opt) -> dict[str, torch.Tensor]:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = v.clone()
    return out


def write(obj) -> None:
    if rank == 0:
        Path(out_path).write_text(json.dumps(obj))


if mode == "grad":
    cells, ranks = int(sys.argv[4]), int(sys.argv[5])
    dtype = sys.argv[6] if len(sys.argv) > 6 else "float32"
    layer_checkpoints = len(sys.argv) > 7 and sys.argv[7] == "checkpoint-layers"
    assert cells * ranks == size
    group = cell_groups(cells, ranks)
    model = sharding.shard_model(build_model(CFG, seed=0), group, dtype=dtype)
    loss = loss_of(model, my_micro(0, rank, size), checkpoint_layers=layer_checkpoints)
    loss.backward()
    stats = sharding.reduce_replicas(model, sharding.replica_comm(world, rank % ranks))
    mean_loss = world.allreduce(loss.item(), op=MPI.SUM) / size
    full = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref = build_model(CFG, seed=0)
    ref_loss = loss_of(ref, batch(0).reshape(-1, T))
    ref_loss.backward()
    worst = max(float((full[n] - p.grad).abs().max() / p.grad.abs().max()) for n, p in ref.named_parameters())
    local_dtype = str(next(model.parameters()).to_local().dtype)
    write({"loss": mean_loss, "ref_loss": float(ref_loss), "max_rel_grad": worst,
           "grad_dtype": str(full["model.norm.weight"].dtype), "master_dtype": local_dtype,
           "replica_bytes": stats.bytes})
elif mode == "hf":
    ranks, root = int(sys.argv[4]), Path(sys.argv[5])
    tokenizer = embedded_tokenizer()
    group = cell_groups(1, ranks)
    model = sharding.shard_model(build_model(replace(CFG, vocab_size=tokenizer.vocab_size), seed=3), group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, my_micro(1, rank, size)).backward()
    opt.step()
    sealed = sharding.save_sharded(root / "checkpoints", CheckpointMeta(step=1, policy_version=1, roles={}),
                                   model, opt, group, tokenizer=tokenizer)
    msd, _ = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in msd.items()}, root / "model-1.pt")
    write({"sealed": str(sealed), "files": sorted(os.listdir(sealed))})
else:
    ranks, root = int(sys.argv[4]), Path(sys.argv[5])
    group = cell_groups(1, ranks)
    model = sharding.shard_model(build_model(CFG, seed=0 if mode == "save" else 7), group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = {}

    def train(step: int) -> None:
        opt.zero_grad()
        loss = loss_of(model, my_micro(step, rank, size))
        loss.backward()
        opt.step()
        losses[step] = world.allreduce(loss.item(), op=MPI.SUM) / size

    if mode == "save":
        train(1)
        sealed = sharding.save_sharded(root / "checkpoints", CheckpointMeta(step=1, policy_version=1, roles={}),
                                       model, opt, group)
        full = full_state(model, opt)
        if rank == 0:
            torch.save(full, root / "full-1.pt")
        train(2)
        train(3)
        write({"losses": losses, "sealed": str(sealed), "files": sorted(os.listdir(sealed))})
    else:
        meta = sharding.load_sharded(root / "checkpoints" / "step-00000001", model, opt, group)
        full = full_state(model, opt)
        saved = torch.load(root / "full-1.pt")
        unequal = sorted(k for k in saved if k not in full or not torch.equal(saved[k], full[k]))
        train(2)
        train(3)
        write({"losses": losses, "step": meta.step, "unequal": unequal, "keys": len(saved),
               "extra_keys": sorted(set(full) - set(saved))})
dist.destroy_process_group()

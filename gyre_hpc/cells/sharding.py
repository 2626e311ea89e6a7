"""The model sharded inside a training cell, replicated across cells (design.md section 9).

Why FSDP2 per decoder layer and at the root: a layer is the unit whose full parameters a rank
holds at once (gathered for its forward and again for its backward, then freed), so the peak is
one layer's full weights plus every layer's 1/N shard; the root group holds the embedding (tied
to the output head) and the final norm. Parameters, gradients and AdamW's moments are DTensors
sharded on dim 0 over the cell's process group, which is created once and never changes.

Why the replicas reduce over MPI and not torch: the elastic part (which cells train this step,
joins, flips, the core cell's authority) lives on the MPI training communicator and changes
every step; torch's groups cannot. Shard k of one cell holds the same slice of every tensor as
shard k of any other cell, so a communicator of the k-th ranks of the training cells
(``replica_comm``) averages the local shards with ``gradsync.allreduce_mean`` exactly as a
1-rank cell averages whole gradients today.

Why checkpoints go through ``torch.distributed.checkpoint``: every rank writes its own shard
and the metadata records which slice of which tensor each file holds, so a checkpoint written
by N ranks loads into any other number of ranks (resharded on read). The files are staged and
sealed by ``cells.checkpoint.commit`` (the same atomic rule as the 1-rank checkpoints): the
directory is renamed into place only after the coordinator has every rank's write result.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from gyre_hpc import fsio
from gyre_hpc.cells import checkpoint as ckpt
from gyre_hpc.cells.export import DCP_METADATA
from gyre_hpc.cells.gradsync import SyncStats, allreduce_mean
from gyre_hpc.models.checkpoint import CONFIG_FILE, CheckpointError, hf_config
from gyre_hpc.models.decoder import CausalLM
from gyre_hpc.models.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, ChatTokenizer

# ``model.dtype`` -> the dtype the layers compute in; master weights, gradients' reduction and
# the optimizer stay float32 whichever is chosen.
PARAM_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def mixed_precision(dtype: str) -> MixedPrecisionPolicy:
    """The FSDP2 policy for ``model.dtype``: bf16 parameters in the forward and backward,
    gradients reduced and kept in float32; float32 is no cast at all."""
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"model.dtype={dtype!r} is unknown for a sharded cell: valid are {', '.join(PARAM_DTYPES)}")
    if dtype == "float32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[dtype], reduce_dtype=torch.float32)


def shard_model(model: CausalLM, group: dist.ProcessGroup, dtype: str = "float32") -> CausalLM:
    """Shard ``model`` in place over ``group`` (the cell's ranks): one FSDP2 unit per decoder
    layer and one at the root. Every rank must pass the same weights (the same seed or the
    same loaded state); each keeps its 1/N slice of them."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"shard_model: model is a {type(model).__name__}, not the project's CausalLM")
    policy = mixed_precision(dtype)
    device = "cuda" if next(model.parameters()).is_cuda else "cpu"
    mesh = DeviceMesh.from_group(group, device_type=device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's slice of every gradient, in parameter order (the same order on every cell);
    the tensors share storage with the gradients, so changing them changes the gradients."""
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if missing:
        raise ValueError(f"local_grads: no gradient on {len(missing)} parameters ({', '.join(missing[:3])}, ...): "
                         "run the backward first (a cell with no data this step backpropagates a zero loss)")
    return [_local(p.grad) for p in model.parameters() if p.requires_grad]


def replica_comm(train_comm: MPI.Intracomm, shard_index: int) -> MPI.Intracomm:
    """The communicator of shard ``shard_index`` across the training cells: split from the
    elastic training communicator, so it holds exactly the cells that train this step."""
    if shard_index < 0:
        raise ValueError(f"replica_comm: shard_index={shard_index} must be >= 0")
    return train_comm.Split(color=shard_index, key=train_comm.Get_rank())


def reduce_replicas(model: torch.nn.Module, comm: MPI.Intracomm, weight: float = 1.0) -> SyncStats:
    """Average this rank's gradient shard with the same shard of the other training cells,
    weighted by the data each cell's gradient stands for (``gradsync.allreduce_mean``)."""
    return allreduce_mean(local_grads(model), comm, weight=weight)


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state this rank holds (its local shards), by kind."""
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> StateBytes:
    """What the training state costs this rank: local shards only, each storage once."""
    def nbytes(ts) -> int:
        return sum(_local(t).numel() * _local(t).element_size() for t in ts)

    params = [p for p in model.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    opt = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                         if isinstance(v, torch.Tensor) and v.dim() > 0]
    return StateBytes(params=nbytes(params), grads=nbytes(grads), optimizer=nbytes(opt))


def _is_coordinator(group: dist.ProcessGroup) -> bool:
    return dist.get_rank(group) == 0


def save_sharded(root: Path, meta: ckpt.CheckpointMeta, model: CausalLM,
                 optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, keep: int = 2,
                 tokenizer: ChatTokenizer | None = None) -> Path:
    """Every rank of ``group`` writes its shards of model and optimizer into the staging dir of
    ``meta.step``; the group's rank 0 seals it (``cells.checkpoint.commit``) once DCP's
    coordinator has every rank's write result, so ``latest`` never names a partial checkpoint.
    Collective over ``group``; returns the sealed directory on every rank.

    Rank 0 also writes the model's HF ``config.json`` (float32, the master weights' type) and
    ``tokenizer`` when given: what ``cells.export`` needs to turn the shards into an HF folder
    without knowing the run that wrote them."""
    root = Path(root)
    staged = root / (ckpt.step_dir_name(meta.step) + ".tmp")
    if _is_coordinator(group):
        ckpt.staging_dir(root, meta.step)
    dist.barrier(group=group)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=staged, process_group=group)
    final = root / ckpt.step_dir_name(meta.step)
    if _is_coordinator(group):
        stored = dcp.FileSystemReader(staged).read_metadata().storage_data
        files = sorted({info.relative_path for info in stored.values()}) + [DCP_METADATA, CONFIG_FILE]
        fsio.write_text(staged / CONFIG_FILE, json.dumps(hf_config(model.config, torch.float32, tokenizer), indent=2))
        if tokenizer is not None:
            tokenizer.save(staged)
            files += [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
        ckpt.commit(root, meta.step, dataclasses.replace(meta, files=files), keep=keep)
    dist.barrier(group=group)
    return final


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: dist.ProcessGroup) -> ckpt.CheckpointMeta:
    """Load a sealed sharded checkpoint into ``model`` and ``optimizer``, sharded over
    ``group`` whatever number of ranks wrote it. Collective over ``group``."""
    directory = Path(directory)
    if not (directory / DCP_METADATA).is_file():
        raise CheckpointError(f"sharded checkpoint {directory}: {DCP_METADATA} is missing "
                              "(not a sharded checkpoint, or not sealed)")
    meta = ckpt.read_meta(directory)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=directory, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return meta

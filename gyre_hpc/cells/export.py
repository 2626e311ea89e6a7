"""``gyre-hpc export CHECKPOINT OUT``: a fleet checkpoint as the HF folder transformers and vLLM open.

A 1-rank cell's checkpoint is already an HF folder with the optimizer state beside it; a
sharded one (``cells.sharding.save_sharded``) holds ``torch.distributed.checkpoint`` shards,
the model's ``config.json`` and its tokenizer. Export reads the model's part of either into one
process (DCP reshards to a single unsharded reader: no process group, no MPI, so it runs on a
login node) and writes it with ``models.checkpoint.save_pretrained``, the writer every other
HF folder of the project goes through. The optimizer state is left behind: an export is for
serving or for starting another run (``model.path``), not for resuming this one.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import click
import torch

from gyre_hpc.cells import checkpoint as ckpt
from gyre_hpc.models.checkpoint import CheckpointError, is_checkpoint, load_pretrained, read_config, save_pretrained
from gyre_hpc.models.decoder import CausalLM
from gyre_hpc.models.tokenizer import TOKENIZER_CONFIG_FILE, embedded_tokenizer, load_tokenizer
from gyre_hpc.rundir.layout import CHECKPOINT_LATEST, CHECKPOINT_META

DCP_METADATA = ".metadata"    # the file torch.distributed.checkpoint writes last (cells.sharding)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory as given, or the one ``latest`` names when ``path`` is a run's
    ``checkpoints/`` folder or the run directory itself."""
    path = Path(path)
    for root in (path, path / "checkpoints"):
        if (root / CHECKPOINT_LATEST).is_file():
            return ckpt.latest_dir(root)
    return path


def is_sharded(directory: Path) -> bool:
    return (Path(directory) / DCP_METADATA).is_file()


def read_sharded_model(directory: Path) -> CausalLM:
    """The whole model of a sharded checkpoint, in float32, in this process."""
    import torch.distributed.checkpoint as dcp

    model = CausalLM(read_config(directory))
    state = {"model": model.state_dict()}
    # No process group: DCP plans the read for one rank that holds every tensor whole.
    dcp.load(state, checkpoint_id=str(directory), no_dist=True)
    model.load_state_dict(state["model"])
    return model


def export_hf(checkpoint: str | Path, out: str | Path, dtype: str = "float32", replace: bool = False) -> Path:
    """Write the model of ``checkpoint`` (sharded or not; a run dir means its latest) as an HF
    folder ``out``; the meta's step and policy version go under ``config.json``'s "gyre" key."""
    directory = resolve_checkpoint(checkpoint)
    out = Path(out)
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: valid are {', '.join(DTYPES)}")
    if out.exists() and (not replace or out.resolve() == directory.resolve()):
        raise CheckpointError(f"{out} exists: pass --force to replace it (never the checkpoint itself)")
    if is_sharded(directory):
        model = read_sharded_model(directory)
    elif is_checkpoint(directory):
        model = load_pretrained(directory, dtype=torch.float32)
    else:
        raise CheckpointError(f"{directory} is no checkpoint: neither {DCP_METADATA} (sharded) nor config.json "
                              f"(one rank) is in it")
    tokenizer = (load_tokenizer(directory) if (directory / TOKENIZER_CONFIG_FILE).is_file()
                 else embedded_tokenizer())
    meta = ckpt.read_meta(directory) if (directory / CHECKPOINT_META).is_file() else None
    extra = {"exported_from": str(directory.resolve())}
    if meta is not None:
        extra |= {"step": meta.step, "policy_version": meta.policy_version}
    if out.exists():
        shutil.rmtree(out)
    return save_pretrained(model.to(DTYPES[dtype]), out, extra=extra, tokenizer=tokenizer)


@click.command("export")
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="float32", show_default=True,
              help="the weights' type in the folder (checkpoints hold float32 master weights)")
@click.option("--force", is_flag=True, help="replace OUT if it exists")
def export(checkpoint: str, out: str, dtype: str, force: bool) -> None:
    """Write CHECKPOINT (a step directory, sharded or not, or a run directory: its latest) as
    the HF folder OUT that transformers and vLLM open."""
    try:
        path = export_hf(checkpoint, out, dtype=dtype, replace=force)
    except (CheckpointError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"exported: {path}")

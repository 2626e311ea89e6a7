"""``gyre-hpc models ...``: commands on model files (``import-gguf``)."""
from __future__ import annotations

import click

DTYPES = ("float32", "bfloat16", "float16")


@click.group()
def models() -> None:
    """Model files: convert them into the HF checkpoint folders the stack reads."""


@models.command("import-gguf")
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--dtype", type=click.Choice(DTYPES), default="float32", show_default=True,
              help="the weights' type in the folder (dequantized GGUF weights are float32)")
@click.option("--force", is_flag=True, help="replace OUT if it exists")
def import_gguf_command(file: str, out: str, dtype: str, force: bool) -> None:
    """Convert the GGUF FILE (Llama architecture) into the checkpoint folder OUT."""
    import torch

    from gyre_hpc.models.gguf_import import import_gguf

    try:
        path = import_gguf(file, out, getattr(torch, dtype), replace=force)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"checkpoint: {path}")

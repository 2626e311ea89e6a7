"""``--model PATH``: the benchmarks on a checkpoint folder instead of a random-init preset.

Why one module: every benchmark that takes a model names it, loads it and refuses a folder it
cannot read the same way, so a figure at real width (SmolLM2-135M, imported with ``gyre-hpc
models import-gguf``) and one on the tiny preset are reported under the same keys.
"""
from __future__ import annotations

from pathlib import Path

import click

model_option = click.option(
    "--model", "model_path", default=None, type=click.Path(exists=True, file_okay=False, resolve_path=True),
    help="a checkpoint folder (HF format: config.json + safetensors; e.g. from `gyre-hpc models import-gguf`) "
         "in place of the random-init preset")


def _config(path: str):
    from gyre_hpc.models.checkpoint import CheckpointError, read_config

    try:
        return read_config(path)
    except CheckpointError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from exc


def max_position(path: str) -> int:
    """The longest sequence (prompt + new tokens) the checkpoint's positions hold."""
    return _config(path).max_position


def load_model(path: str):
    """The checkpoint's model; a folder that is not one is a usage error naming ``--model``."""
    from gyre_hpc.models.checkpoint import CheckpointError, load_pretrained

    _config(path)
    try:
        return load_pretrained(path)
    except CheckpointError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from exc


def meta_model(path: str):
    """The checkpoint's model on the meta device: its shapes and parameter count from config.json
    alone, for a benchmark that needs its size but not its weights."""
    import torch

    from gyre_hpc.models.decoder import CausalLM

    cfg = _config(path)
    with torch.device("meta"):
        return CausalLM(cfg)


def state_bytes(path: str) -> int:
    """Bytes of the checkpoint's parameters in float32, as the engines and trainers hold them."""
    return meta_model(path).n_params * 4


def describe(path: str | None, model, preset: str) -> dict:
    """What the JSON says about the model a figure came from."""
    cfg = model.config
    return {"weights": f"checkpoint {Path(path).name}" if path else f"preset {preset} (random init)",
            "path": path, "preset": None if path else preset, "params": model.n_params, "d_model": cfg.d_model,
            "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads,
            "vocab_size": cfg.vocab_size, "max_position": cfg.max_position}

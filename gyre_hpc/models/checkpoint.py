"""HF-format checkpoint directories: ``config.json`` + ``model.safetensors``.

Why HF format: a checkpoint is the hand-off to everything outside this project (vLLM,
transformers, a notebook). The config keys are HF Llama's, the parameter names are HF
Llama's, so ``LlamaForCausalLM.from_pretrained(dir)`` reads the same directory. Anything
this project needs beyond HF's keys lives under ``"gyre"`` in the same file.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gyre_hpc.models.tiny_lm import BOS_ID, EOS_ID, PAD_ID, LMConfig, TinyLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

# LMConfig field -> HF Llama config key.
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_position": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    "norm_eps": "rms_norm_eps",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file."""


def hf_config(cfg: LMConfig, dtype: torch.dtype) -> dict:
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    out.update({hf: getattr(cfg, ours) for ours, hf in _HF_KEYS.items()})
    out.update({
        "num_key_value_heads": cfg.n_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    return out


def save_pretrained(model: TinyLM, directory: str | Path, extra: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors``; ``extra`` goes under the "gyre" key."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    config = hf_config(model.config, dtype)
    if extra:
        config["gyre"] = extra
    # Weights first, config last: a directory with a config is a complete checkpoint.
    save_file(state, str(d / WEIGHTS_FILE), metadata={"format": "pt"})
    (d / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return d


def read_config(directory: str | Path) -> LMConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: top level must be an object, got {type(raw).__name__}")
    missing = [hf for hf in _HF_KEYS.values() if hf not in raw]
    # tie_word_embeddings / rms_norm_eps have HF defaults; the rest must be stated.
    missing = [k for k in missing if k not in ("tie_word_embeddings", "rms_norm_eps")]
    if missing:
        raise CheckpointError(f"{path}: missing keys {', '.join(missing)}")
    kv_heads = raw.get("num_key_value_heads", raw["num_attention_heads"])
    if kv_heads != raw["num_attention_heads"]:
        raise CheckpointError(
            f"{path}: num_key_value_heads={kv_heads} != num_attention_heads={raw['num_attention_heads']}; "
            f"TinyLM has no grouped-query attention")
    kwargs = {ours: raw[hf] for ours, hf in _HF_KEYS.items() if hf in raw}
    try:
        return LMConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def load_pretrained(directory: str | Path, dtype: torch.dtype | None = None) -> TinyLM:
    """Load a directory written by :func:`save_pretrained` (or an HF Llama of the same shape)."""
    cfg = read_config(directory)
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: {path} does not exist")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    # An HF writer may store a tied lm_head explicitly; it is the embedding.
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    stored = next(iter(state.values())).dtype
    model = TinyLM(cfg).to(stored)  # load at the stored precision, cast after
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match {CONFIG_FILE}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    bad = [k for k in expected if tuple(state[k].shape) != tuple(expected[k].shape)]
    if bad:
        k = bad[0]
        raise CheckpointError(
            f"{path}: tensor {k} has shape {tuple(state[k].shape)}, {CONFIG_FILE} implies {tuple(expected[k].shape)}")
    model.load_state_dict(state)
    return model.to(dtype or stored)

"""HF checkpoint folders: ``config.json``, safetensors (one file or sharded), ``generation_config.json``
and the tokenizer files.

Why HF format: a checkpoint is the hand-off to everything outside this project (vLLM,
transformers, a notebook). ``save_pretrained`` writes a folder that
``AutoModelForCausalLM``/``AutoTokenizer`` and vLLM open from the folder alone;
``load_pretrained`` reads any local Qwen2/Qwen2.5/Qwen3/Llama checkpoint. Anything this
project needs beyond HF's keys lives under ``"gyre"`` in ``config.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from gyre_hpc import fsio
from gyre_hpc.models.decoder import CausalLM, LMConfig
from gyre_hpc.models.jsonfile import read_json_object
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# HF architecture name -> (family, model_type)
ARCHITECTURES = {
    "Qwen2ForCausalLM": ("qwen2", "qwen2"),
    "Qwen3ForCausalLM": ("qwen3", "qwen3"),
    "LlamaForCausalLM": ("llama", "llama"),
}
_ARCH_OF_FAMILY = {fam: arch for arch, (fam, _) in ARCHITECTURES.items()}

# LMConfig field -> HF config key (every family).
_HF_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "d_ff": "intermediate_size",
    "max_position": "max_position_embeddings",
}
_HF_DEFAULTS = {"tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or loaded, an HF folder or a fleet's step directory
    (``cells.checkpoint``); the message names the file (and tensor). One type for both, defined
    here on the lower floor: a caller catches one error, and the head's ``same_failure`` compares
    one type name."""


def hf_config(cfg: LMConfig, dtype: torch.dtype, tokenizer: ChatTokenizer | None = None) -> dict:
    arch = _ARCH_OF_FAMILY[cfg.family]
    out: dict = {"architectures": [arch], "model_type": ARCHITECTURES[arch][1]}
    out.update({hf: getattr(cfg, ours) for ours, hf in _HF_KEYS.items()})
    out.update({
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dh,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    if cfg.family == "llama":
        out.update({"attention_bias": cfg.attention_bias, "mlp_bias": cfg.mlp_bias})
    elif cfg.family == "qwen3":
        out.update({"attention_bias": cfg.attention_bias})
    if cfg.family in ("qwen2", "qwen3"):
        out.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers})
    if tokenizer is not None:
        out.update({"bos_token_id": None, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id})
    return out


def save_pretrained(model: CausalLM, directory: str | Path, extra: dict | None = None,
                    tokenizer: ChatTokenizer | None = None) -> Path:
    """Write config, weights, generation config and tokenizer (default: the embedded one).

    ``extra`` goes under the "gyre" key of ``config.json``.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or embedded_tokenizer()
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"checkpoint {d}: the tokenizer has {tokenizer.vocab_size} ids, the model's "
                              f"vocab_size is {model.config.vocab_size}")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    dtype = next(iter(state.values())).dtype
    config = hf_config(model.config, dtype, tokenizer)
    if extra:
        config["gyre"] = extra
    # Everything else first, config last: a directory with a config is a complete checkpoint.
    with fsio.naming_full_disk(d / WEIGHTS_FILE):
        save_file(state, str(d / WEIGHTS_FILE), metadata={"format": "pt"})
    # A one-shard index: vLLM loads every *.safetensors in the folder unless an index names
    # the weight files, and checkpoints keep other safetensors beside the model (optimizer state).
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": {name: WEIGHTS_FILE for name in sorted(state)}}
    (d / WEIGHTS_INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    tokenizer.save(d)
    generation = {"eos_token_id": list(tokenizer.stop_ids()[:2]), "pad_token_id": tokenizer.pad_id,
                  "do_sample": True, "temperature": 1.0, "top_p": 1.0}
    (d / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    (d / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return d


def _read_json(path: Path) -> dict:
    return read_json_object(path, CheckpointError)


def _rope(raw: dict, path: Path) -> tuple[float, tuple | None]:
    """(theta, llama3 scaling) from the legacy keys or transformers 5's ``rope_parameters``."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = float(raw.get("rope_theta", params.get("rope_theta", _HF_DEFAULTS["rope_theta"])))
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope scaling type {kind!r} is not supported (supported: none, llama3)")
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keep if k not in scaling]
    if missing:
        raise CheckpointError(f"{path}: rope_scaling lacks {', '.join(missing)}")
    return theta, tuple(sorted((k, float(scaling[k])) for k in keep)) + (("rope_type", "llama3"),)


def is_checkpoint(directory: str | Path) -> bool:
    """Whether ``directory`` is an HF-format checkpoint, by its ``config.json``: the file every
    reader opens first, and the last one ``save_pretrained`` writes (a half-written directory has none)."""
    return (Path(directory) / CONFIG_FILE).is_file()


def read_config(directory: str | Path) -> LMConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory}: {path} does not exist")
    raw = _read_json(path)
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(f"{path}: architectures={archs} is not supported: supported are "
                              f"{', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[arch][0]
    missing = [hf for hf in _HF_KEYS.values() if hf not in raw]
    if missing:
        raise CheckpointError(f"{path}: missing keys {', '.join(missing)}")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{path}: hidden_act={raw['hidden_act']!r} is not supported (silu only)")
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        raise CheckpointError(f"{path}: use_sliding_window=true is not supported")
    theta, scaling = _rope(raw, path)
    kwargs = {ours: raw[hf] for ours, hf in _HF_KEYS.items()}
    kwargs.update(
        n_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
        # Stated apart only where it differs from hidden_size / heads (Qwen3), so configs compare equal.
        head_dim=None if raw.get("head_dim") in (None, raw["hidden_size"] // raw["num_attention_heads"])
        else raw["head_dim"],
        rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(raw.get("tie_word_embeddings", _HF_DEFAULTS["tie_word_embeddings"])),
        norm_eps=float(raw.get("rms_norm_eps", _HF_DEFAULTS["rms_norm_eps"])),
        family=family,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)) if family == "llama" else False,
    )
    try:
        return LMConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, else the one model file."""
    index = d / WEIGHTS_INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map object")
        return [d / name for name in sorted(set(weight_map.values()))]
    return [d / WEIGHTS_FILE]


def read_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors (one file or the shards of an index)."""
    d = Path(directory)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(d):
        if not path.is_file():
            raise CheckpointError(f"checkpoint {d}: {path} does not exist")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None
    return state


def check_state_dict(state, expected, where: str) -> None:
    """Names and shapes of ``state`` against ``expected``; the error names the tensors."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
    for k in expected:
        if tuple(state[k].shape) != tuple(expected[k].shape):
            raise CheckpointError(f"{where}: tensor {k} has shape {tuple(state[k].shape)}, "
                                  f"the model needs {tuple(expected[k].shape)}")


def load_pretrained(directory: str | Path, dtype: torch.dtype | None = None) -> CausalLM:
    """Load a checkpoint folder (ours, or a local HF Qwen2/Qwen2.5/Qwen3/Llama checkpoint)."""
    cfg = read_config(directory)
    state = read_state(directory)
    # An HF writer may store a tied lm_head explicitly; it is the embedding.
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    stored = next(iter(state.values())).dtype if state else torch.float32
    with torch.device("meta"):
        model = CausalLM(cfg)
    check_state_dict(state, model.state_dict(), f"{Path(directory) / WEIGHTS_FILE} vs {CONFIG_FILE}")
    model = model.to_empty(device="cpu").to(stored)
    model.load_state_dict(state)
    return model.to(dtype or stored)

"""GGUF files (llama.cpp's format) turned into HF checkpoint folders the whole stack reads.

Why convert once rather than read GGUF everywhere: every reader here (``load_pretrained``,
vLLM, transformers, the trainer's checkpoints) already opens an HF folder; a GGUF is read once,
dequantized to float, and written as one (safetensors, tokenizer, chat template, config last).

What a GGUF changes that must be undone, and why:

- llama.cpp stores a Llama's q and k projections with each head's rows permuted (its rotary
  kernel pairs neighbouring rows, HF's pairs row i with row i + head_dim/2);
  :func:`unpermute_rows` puts them back, per head of that projection (q: the attention heads,
  k: the key/value heads);
- it has no ``tokenizer.json``: the vocabulary, merges, token types and the pre-tokenizer's
  name are metadata keys, rebuilt here as a ``tokenizers`` byte-level BPE
  (:func:`gguf_tokenizer`). A pre-tokenizer this module does not know is an error rather than
  a tokenizer that splits text differently from the one the model was trained with;
- weights may be block-quantized; the ``gguf`` package dequantizes each (an unknown type is an
  error naming the tensor and the type).

``tokenizer.ggml.add_bos_token`` is not carried over: the chat templates of the files this
targets begin each turn with their own ``<|im_start|>``, and the stack encodes without
specials.
"""
from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gyre_hpc import fsio
from gyre_hpc.models.checkpoint import CheckpointError, check_state_dict, save_pretrained
from gyre_hpc.models.decoder import CausalLM, LMConfig
from gyre_hpc.models.tokenizer import ChatTokenizer

ARCHITECTURES = ("llama",)
TOKENIZER_MODELS = ("gpt2",)
# tokenizer.ggml.pre -> whether digits are split one by one before the GPT-2 regex (llama.cpp's
# STARCODER group, which SmolLM's tokenizer.json spells as Digits(individual) + ByteLevel).
PRE_TOKENIZERS = {"default": False, "gpt2": False, "smollm": True, "starcoder": True, "refact": True}
_CONTROL, _USER_DEFINED = 3, 4          # llama.cpp's token types

# GGUF tensor name (per block after "blk.N.") -> HF name (after "model.layers.N.").
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF holds, read: its metadata (plain Python values) and its tensors, dequantized
    to float32 in HF's row-major shape, under their GGUF names."""

    path: Path
    metadata: dict
    tensors: dict[str, np.ndarray]


def read_gguf(path: str | Path) -> GGUFModel:
    """Read and dequantize a whole GGUF file (the edge: file I/O through the ``gguf`` package)."""
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading a GGUF file needs the gguf package: pip install 'gyre-hpc[gguf]'") from None
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - a cut file fails inside numpy (ValueError, IndexError, ...)
        raise CheckpointError(f"{path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None
    metadata = {name: field.contents() for name, field in reader.fields.items()}
    tensors = {}
    for t in reader.tensors:
        try:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise CheckpointError(f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which the gguf "
                                  f"package cannot dequantize") from None
        tensors[t.name] = np.asarray(values, dtype=np.float32).reshape([int(n) for n in reversed(t.shape)])
    return GGUFModel(path, metadata, tensors)


def _key(model: GGUFModel, key: str, default=None):
    value = model.metadata.get(key, default)
    if value is None:
        raise CheckpointError(f"{model.path}: metadata key {key} is missing")
    return value


def _float32(value) -> float:
    """A float32 key as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def lm_config(model: GGUFModel) -> LMConfig:
    """The decoder's config from a Llama GGUF's ``llama.*`` keys and its tensors' shapes."""
    arch = model.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{model.path}: general.architecture={arch!r} cannot be converted "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    scaling = model.metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{model.path}: {arch}.rope.scaling.type={scaling!r} cannot be converted (none only)")
    d_model = int(_key(model, f"{arch}.embedding_length"))
    n_heads = int(_key(model, f"{arch}.attention.head_count"))
    head_dim = int(model.metadata.get(f"{arch}.attention.key_length", d_model // n_heads))
    rotary = int(model.metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise CheckpointError(f"{model.path}: {arch}.rope.dimension_count={rotary} is not the head size {head_dim} "
                              f"(partial rotary cannot be converted)")
    embed = model.tensors.get("token_embd.weight")
    if embed is None:
        raise CheckpointError(f"{model.path}: tensor token_embd.weight is missing")
    try:
        return LMConfig(
            vocab_size=embed.shape[0], d_model=d_model, n_layers=int(_key(model, f"{arch}.block_count")),
            n_heads=n_heads, n_kv_heads=int(model.metadata.get(f"{arch}.attention.head_count_kv", n_heads)),
            head_dim=None if head_dim == d_model // n_heads else head_dim,
            d_ff=int(_key(model, f"{arch}.feed_forward_length")),
            max_position=int(model.metadata.get(f"{arch}.context_length", 2048)),
            rope_theta=_float32(model.metadata.get(f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=_float32(model.metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="output.weight" not in model.tensors,
            family="llama", qkv_bias=False, qk_norm=False,
            attention_bias="blk.0.attn_q.bias" in model.tensors, mlp_bias="blk.0.ffn_up.bias" in model.tensors,
        )
    except ValueError as exc:
        raise CheckpointError(f"{model.path}: {exc}") from None


def unpermute_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: within each head its rows were interleaved (pair j at
    rows 2j, 2j+1); HF keeps the halves apart (rows j and j + head_dim/2). Weights and biases."""
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_state(model: GGUFModel, cfg: LMConfig) -> dict[str, torch.Tensor]:
    """The tensors under HF Llama names, q and k un-permuted; an unknown tensor is an error."""
    state = {}
    for name, values in model.tensors.items():
        stem, _, kind = name.rpartition(".")
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_TENSORS:
            hf = f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}"
            if parts[2] == "attn_q":
                values = unpermute_rows(values, cfg.n_heads)
            elif parts[2] == "attn_k":
                values = unpermute_rows(values, cfg.kv_heads)
        elif stem in _TOP_TENSORS:
            hf = _TOP_TENSORS[stem]
        else:
            raise CheckpointError(f"{model.path}: tensor {name} has no counterpart in an HF Llama checkpoint")
        # An F32 tensor is a read-only view of the memory-mapped file: copied; a dequantized one is shared.
        state[f"{hf}.{kind}"] = torch.from_numpy(values if values.flags.writeable else values.copy())
    return state


def gguf_tokenizer(model: GGUFModel) -> ChatTokenizer:
    """A byte-level BPE from the ``tokenizer.*`` keys: vocabulary, merges, control tokens as
    specials, the pre-tokenizer the name says, and ``tokenizer.chat_template``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = model.metadata.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise CheckpointError(f"{model.path}: tokenizer.ggml.model={kind!r} cannot be converted "
                              f"(supported: {', '.join(TOKENIZER_MODELS)}, byte-level BPE)")
    pre = model.metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{model.path}: tokenizer.ggml.pre={pre!r} cannot be converted "
                              f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = list(_key(model, "tokenizer.ggml.tokens"))
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{model.path}: tokenizer.ggml.tokens lists a token twice")
    merges = [tuple(m.split(" ")) for m in _key(model, "tokenizer.ggml.merges")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise CheckpointError(f"{model.path}: tokenizer.ggml.merges has {' '.join(bad)!r}, not a pair")
    template = _key(model, "tokenizer.chat_template")
    eos = int(_key(model, "tokenizer.ggml.eos_token_id"))
    pad = int(model.metadata.get("tokenizer.ggml.padding_token_id", eos))
    for key, i in (("eos_token_id", eos), ("padding_token_id", pad)):
        if not 0 <= i < len(tokens):
            raise CheckpointError(f"{model.path}: tokenizer.ggml.{key}={i} is outside the {len(tokens)} tokens")

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if PRE_TOKENIZERS[pre] else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.encode_special_tokens = True    # as load_tokenizer's: text never forges a turn boundary
    types = list(model.metadata.get("tokenizer.ggml.token_type") or ())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    return ChatTokenizer(tok, template, tokens[eos], tokens[pad])


def convert(model: GGUFModel, dtype: torch.dtype = torch.float32) -> tuple[CausalLM, ChatTokenizer]:
    """The decoder (weights loaded, checked against the config) and the tokenizer of a read GGUF."""
    cfg = lm_config(model)
    state = hf_state(model, cfg)
    with torch.device("meta"):
        lm = CausalLM(cfg)
    check_state_dict(state, lm.state_dict(), str(model.path))
    lm.load_state_dict(state, assign=True)
    return lm.to(dtype).eval(), gguf_tokenizer(model)


def import_gguf(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32,
                replace: bool = False) -> Path:
    """Convert the GGUF at ``path`` into the checkpoint folder ``out``.

    Built in a hidden folder beside ``out`` and renamed into place (``save_pretrained`` writes
    config.json last inside it): a reader never sees a partial folder, and a killed import
    leaves ``out`` as it was. An existing ``out`` is an error unless ``replace``.
    """
    out = Path(out)
    if out.exists() and not replace:
        raise CheckpointError(f"{out} already exists (replace it with --force)")
    lm, tokenizer = convert(read_gguf(path), dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = out.with_name(f".{out.name}.{uuid.uuid4().hex[:12]}.importing")
    try:
        save_pretrained(lm, staged, extra={"imported_from": Path(path).name}, tokenizer=tokenizer)
        fsio.replace_dir(staged, out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out

"""A standard decoder-only causal LM (the Qwen2 / Qwen3 / Llama shape), readable top to bottom.

Why this shape: the checkpoints users train and serve are Qwen- and Llama-family models, so
the model is theirs, parameter name for parameter name: ``model.embed_tokens``,
``model.layers.N.self_attn.{q,k,v,o}_proj``, ``input_layernorm``, ``mlp.{gate,up,down}_proj``,
``model.norm``, ``lm_head``. A state dict round-trips with ``transformers`` and vLLM without
a conversion step. The three families differ only in switches of ``LMConfig``:

- grouped-query attention (``n_kv_heads`` < ``n_heads``): every family;
- ``qkv_bias``: Qwen2/Qwen2.5 put biases on q, k and v (not o);
- ``qk_norm``: Qwen3 RMS-normalises each head of q and k before the rotary embedding;
- ``attention_bias`` / ``mlp_bias``: Llama's optional biases on every projection;
- ``rope_scaling``: Llama 3's frequency rescaling ("llama3"), or none.

Why rotary positions matter here: the trainer feeds each token its depth along its own tree
path as its position id, and a decoding engine feeds absolute positions; with RoPE a position
is just a number fed per token, so both need nothing special.

The model knows nothing of cells, MPI or trees. Three ways in for attention:
- default: causal SDPA over the new tokens (optionally after ``past_kv``, the legacy cache);
- ``attention_fn(q, k, v)``: replaces the kernel (tree attention for training); with GQA the
  model expands k, v to all query heads first, so the function sees [B, Hq, T, Dh] each;
- ``kv_cache.attend(layer, q, k, v)``: an engine's cache (contract 1). It receives the NEW
  tokens' q [B, Hq, T, Dh] and k, v [B, Hkv, T, Dh] after RoPE, stores k, v, and returns the
  attention over its past + the new tokens; the model then builds no mask and no past tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gyre_hpc.models import invariant as inv
from gyre_hpc.models.tokenizer import EMBEDDED_VOCAB_SIZE

# (q, k, v) [B, H, T, Dh] / [B, H, S, Dh] -> out [B, H, T, Dh]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PastKV = list[tuple[torch.Tensor, torch.Tensor]]
FAMILIES = ("qwen2", "qwen3", "llama")


class KVCacheHook(Protocol):
    """Contract 1: what an engine's KV cache offers the model."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = EMBEDDED_VOCAB_SIZE
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    n_kv_heads: int | None = None        # None: as many as n_heads (no GQA); resolved to an int
    head_dim: int | None = None          # None: d_model // n_heads (Qwen3 states it apart); resolved to an int
    d_ff: int = 172
    max_position: int = 32768
    rope_theta: float = 10000.0
    # Llama 3 rescaling as a sorted tuple of (key, value) pairs, so the config stays hashable.
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    family: str = "qwen2"
    qkv_bias: bool = True
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"LMConfig.{name}={getattr(self, name)} must be >= 1")
        if self.family not in FAMILIES:
            raise ValueError(f"LMConfig.family={self.family!r} is unknown: valid families are {', '.join(FAMILIES)}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"LMConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        # Resolved here so every reader sees ints (``cfg.head_dim``, ``cfg.n_kv_heads``).
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.n_heads % self.kv_heads:
            raise ValueError(f"LMConfig.n_heads={self.n_heads} is not a multiple of n_kv_heads={self.kv_heads}")
        if self.dh % 2:
            raise ValueError(f"LMConfig head size {self.dh} must be even for rotary positions")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    @property
    def dh(self) -> int:
        """The head size (same as ``head_dim``)."""
        return self.head_dim


# Head size 32: vLLM's CPU attention backend refuses smaller heads (16 fails at the first forward).
PRESETS: dict[str, LMConfig] = {
    "tiny": LMConfig(d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=172),
    "small": LMConfig(d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=344),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in at least float32, as HF does: bf16 squares lose the variance's low bits.
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: LMConfig) -> torch.Tensor:
    """Inverse frequencies (float64), with Llama 3's rescaling of the long wavelengths if configured."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.dh, 2, dtype=torch.float64, device="cpu") / cfg.dh))
    if cfg.rope_scaling is None:
        return inv_freq
    s = dict(cfg.rope_scaling)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


def rotary_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos/sin [B, 1, T, Dh] for the "rotate half" convention.

    Angles are computed in float64 and only then cast: position * inv_freq reaches 6.5e4
    radians at long contexts, where float32 angles lose the low bits that distinguish
    neighbouring positions.
    """
    angles = position_ids.to(torch.float64)[..., None] * inv_freq.to(position_ids.device)  # [B, T, Dh/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]                                   # [B, 1, T, Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def expand_kv(t: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, Dh] -> [B, Hkv * n_rep, S, Dh]: query head h reads kv head h // n_rep (HF's order)."""
    return t if n_rep == 1 else t.repeat_interleave(n_rep, dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.dh
        qkv_bias = cfg.qkv_bias or cfg.attention_bias
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin, attn_mask, past, attention_fn, kv_cache, invariant=False):
        B, T, _ = x.shape
        q = project(self.q_proj, x, invariant).view(B, T, self.n_heads, self.head_dim)
        k = project(self.k_proj, x, invariant).view(B, T, self.n_kv, self.head_dim)
        v = project(self.v_proj, x, invariant).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        new_kv = None
        if kv_cache is not None:
            out = kv_cache.attend(self.layer, q, k, v)
        else:
            if past is not None:
                k = torch.cat([past[0], k], dim=2)
                v = torch.cat([past[1], v], dim=2)
            new_kv = (k, v)
            rep = self.n_heads // self.n_kv
            if invariant and attention_fn is None:
                if attn_mask is not None:
                    raise ValueError("CausalLM.forward: invariant numerics take no attn_mask (pass an "
                                     "attention_fn built for them, or none for causal attention)")
                # New tokens see the past and each other causally: query i sits at S_past + i.
                out = inv.attention(q, k, v, inv.causal_positions(B, k.shape[2] - T, T, x.device))
                out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
                return project(self.o_proj, out, invariant), new_kv
            k, v = expand_kv(k, rep), expand_kv(v, rep)
            if attention_fn is not None:
                out = attention_fn(q, k, v)
            elif attn_mask is not None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
            elif k.shape[2] == T:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                # New tokens see all of the cache and each other causally: query i sits at
                # cache offset S_past + i.
                s_past = k.shape[2] - T
                q_at = torch.arange(T, device=x.device)[:, None] + s_past
                mask = torch.arange(k.shape[2], device=x.device)[None, :] <= q_at
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return project(self.o_proj, out, invariant), new_kv


def project(layer: nn.Linear, x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """A linear layer, through the invariant product when asked."""
    return inv.linear(x, layer.weight, layer.bias) if invariant else layer(x)


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x, invariant=False):
        if invariant:
            return project(self.down_proj, inv.silu(project(self.gate_proj, x, True)) * project(self.up_proj, x, True),
                           True)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn_mask, past, attention_fn, kv_cache, invariant=False):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, past, attention_fn, kv_cache, invariant)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x), invariant)
        return x, kv


class Trunk(nn.Module):
    """The layers, named ``model`` inside CausalLM so parameter names match HF's."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.config = cfg
        self.model = Trunk(cfg)
        # Tied embeddings keep no lm_head parameter at all, so the state dict (and the
        # safetensors file, which refuses aliased tensors) holds each weight once.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Not a buffer: it stays float64 whatever dtype the model is cast to.
        self._inv_freq = rope_inv_freq(cfg)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past_kv: PastKV | None = None,
        use_cache: bool = False,
        attention_fn: AttentionFn | None = None,
        kv_cache: KVCacheHook | None = None,
        invariant: bool = False,
        head: bool = True,
        checkpoint_layers: bool = False,
    ):
        """Logits [B, T, V]; with ``use_cache`` also the per-layer (k, v) [B, Hkv, S_past+T, Dh].

        ``head=False``: the final norm's hidden states [B, T, d_model] in place of the logits,
        for a caller that applies ``output_weight`` to a few rows at a time (the trainer:
        ``trees.token_logprobs``; at a 49K vocabulary the full logits are the step's largest tensor).
        ``checkpoint_layers`` (``train.activation_checkpointing``): under autograd each layer keeps
        only its inputs and is recomputed in the backward, so a step holds one layer's activations
        (and its expanded keys and values) at a time, not every layer's.

        ``invariant``: every product and the causal attention through ``models.invariant``, so a
        token's logits do not depend on the batch, the chunking or the cache (an attention_fn or
        kv_cache passed with it must be invariant too: the tree's and the engine's are).

        ``attn_mask``: None means causal among the T new tokens and full over ``past_kv``;
        otherwise a bool tensor broadcastable to [B, Hq, T, S_past+T], True = may attend.
        ``attention_fn(q, k, v)`` replaces the attention kernel (and the mask); ``kv_cache``
        (contract 1) replaces the kernel and the cache: the model passes it the new tokens only.
        """
        if input_ids.shape != position_ids.shape:
            raise ValueError(
                f"CausalLM.forward: input_ids {tuple(input_ids.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must have the same [B, T] shape")
        if attention_fn is not None and attn_mask is not None:
            raise ValueError(
                "CausalLM.forward: pass attn_mask or attention_fn, not both (attention_fn replaces the mask)")
        if kv_cache is not None and (past_kv is not None or use_cache or attention_fn is not None or attn_mask is not None):
            raise ValueError("CausalLM.forward: kv_cache replaces attn_mask, past_kv, use_cache and attention_fn; "
                             "pass it alone")
        if past_kv is not None and len(past_kv) != len(self.model.layers):
            raise ValueError(f"CausalLM.forward: past_kv has {len(past_kv)} layers, the model {len(self.model.layers)}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self._inv_freq, x.dtype)
        new_past: PastKV = []
        for i, layer in enumerate(self.model.layers):
            past = past_kv[i] if past_kv is not None else None
            if checkpoint_layers and kv_cache is None and torch.is_grad_enabled():
                x, kv = checkpoint(layer, x, cos, sin, attn_mask, past, attention_fn, kv_cache, invariant,
                                   use_reentrant=False)
            else:
                x, kv = layer(x, cos, sin, attn_mask, past, attention_fn, kv_cache, invariant)
            new_past.append(kv)
        x = self.model.norm(x)
        if head:
            weight = self.output_weight
            x = inv.linear(x, weight) if invariant else x @ weight.T
        return (x, new_past) if use_cache else x

    @property
    def output_weight(self) -> torch.Tensor:
        """The output head's [V, d_model] weight: ``lm_head``'s, or the embedding where tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: CausalLM, seed: int) -> CausalLM:
    """Deterministic random weights from ``seed`` with a private generator (no global RNG state)."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = model.config.n_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            std = 0.02
            # GPT-2's scaled init for projections that add into the residual stream keeps the
            # residual variance flat with depth.
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                std = 0.02 / math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return model


def build_model(preset: str | LMConfig = "tiny", seed: int = 0) -> CausalLM:
    """A model with seeded random weights; nothing is downloaded."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"model preset {preset!r} is unknown: valid presets are {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    return init_weights(CausalLM(preset), seed)

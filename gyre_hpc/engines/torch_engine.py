"""TorchEngine: continuous batching over a TinyLM with a real KV cache; the CPU reference.

Cache layout: one token-major buffer per sequence and layer, [capacity, heads, head_dim],
allocated once at admission with capacity = prompt + max_new_tokens (the request states its
own bound, so a cache never grows and never moves). Exporting a sequence hands out views
of these buffers (no copy); importing copies into a fresh buffer.

Batched decode: sequences of different lengths decode together by gathering their caches
into one right-padded [B, H, S_max, Dh] past and masking the padding; each sequence's new
key/value is then written back into its own buffer. Sequences join (after their prefill)
and leave (on a stop token or spent budget) between iterations. Padding costs a gather per
step; in exchange the per-sequence buffers make export, import and finishing O(1)
bookkeeping with no compaction of a shared cache.

Prefill runs one sequence at a time in chunks of ``prefill_chunk`` tokens, so a 32K prompt
never builds a 32K x 32K mask (each chunk's mask is chunk x context).

Exactness: each request samples from its own generator (see ``sampling``); batch
composition changes only float rounding of the logits (different matmul shapes), so greedy
tokens match one-at-a-time decoding and logprobs agree to ~1e-6. A migrated sequence gets
the very cache tensors it had, so it continues bit-exactly.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from gyre_hpc.engines.base import Engine, EngineBookkeeping, EngineError, EngineLoad, outstanding_tokens_of
from gyre_hpc.engines.kv_state import KVLayout, KVState, generator_from_state, generator_state
from gyre_hpc.engines.requests import Output, Request, TokenEvent
from gyre_hpc.engines.sampling import sample_token
from gyre_hpc.models.tiny_lm import TinyLM


@dataclass
class _Sequence:
    request: Request
    seed: int | None
    generator: torch.Generator | None
    policy_version: int
    migrations: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)   # per layer [capacity, H, Dh]
    v: list[torch.Tensor] = field(default_factory=list)
    length: int = 0                                        # tokens in the cache

    @property
    def prefilled(self) -> bool:
        return bool(self.k)


class TorchEngine(EngineBookkeeping, Engine):
    def __init__(self, model: TinyLM, name: str = "torch", *, version: int = 0, max_batch: int = 32,
                 prefill_chunk: int = 1024, seed: int = 0):
        if max_batch < 1:
            raise ValueError(f"TorchEngine.max_batch={max_batch} must be >= 1")
        if prefill_chunk < 1:
            raise ValueError(f"TorchEngine.prefill_chunk={prefill_chunk} must be >= 1")
        self.name = name
        self.model = model.eval()
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._version = version
        cfg = model.config
        dtype = next(model.parameters()).dtype
        self._layout = KVLayout(cfg.n_layers, cfg.kv_heads, cfg.dh, str(dtype).removeprefix("torch."))
        self._device = next(model.parameters()).device
        self._seed_source = torch.Generator().manual_seed(seed)
        self._queue: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._finished: OrderedDict[str, Output] = OrderedDict()
        self._accepting = True
        self._asleep = 0          # 0 awake, else the sleep level
        self._needs_weights = False
        self._c = dict(prefill_tokens=0, decode_tokens=0, migrations_in=0, migrations_out=0, requests_finished=0)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None, **kwargs) -> "TorchEngine":
        """An engine over any HF-format TinyLM checkpoint directory."""
        from gyre_hpc.models.checkpoint import load_pretrained

        return cls(load_pretrained(directory, dtype=dtype), **kwargs)

    # -- state ---------------------------------------------------------------------------
    def request_ids(self) -> list[str]:
        return [s.request.request_id for s in self._running] + [s.request.request_id for s in self._queue]

    def load(self) -> EngineLoad:
        seqs = list(self._running) + list(self._queue)
        return EngineLoad(
            queued=len(self._queue), running=len(self._running),
            kv_tokens=sum(s.length for s in self._running),
            outstanding_tokens=sum(outstanding_tokens_of(s.request, len(s.tokens), s.prefilled) for s in seqs))

    def _find(self, request_id: str) -> _Sequence | None:
        for s in self._running:
            if s.request.request_id == request_id:
                return s
        for s in self._queue:
            if s.request.request_id == request_id:
                return s
        return None

    def _check_new(self, request: Request) -> None:
        rid = request.request_id
        if self._find(rid) is not None or rid in self._finished:
            raise ValueError(f"engine {self.name}: request_id {rid!r} is already in this engine")
        bad = [t for t in request.prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise ValueError(f"Request {rid}: prompt_ids has ids {bad[:5]} outside the vocabulary "
                             f"0..{self.model.config.vocab_size - 1}")
        need = request.prompt_len + request.params.max_new_tokens
        if need > self.model.config.max_position:
            raise ValueError(f"Request {rid}: prompt_len={request.prompt_len} + max_new_tokens="
                             f"{request.params.max_new_tokens} = {need} exceeds the model's max_position="
                             f"{self.model.config.max_position}")

    # -- requests ------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        if not self._accepting:
            raise EngineError(f"engine {self.name} is draining and admits no requests: open() first")
        self._check_usable("submit")
        self._check_new(request)
        seed = request.params.seed
        if seed is None and not request.params.greedy:
            seed = int(torch.randint(0, 2**62, (), generator=self._seed_source))
        gen = None if request.params.greedy else torch.Generator().manual_seed(seed)
        self._queue.append(_Sequence(request, seed, gen, self._version))

    def step(self) -> list[TokenEvent]:
        self._check_usable("step")
        with torch.no_grad():
            events = self._decode(list(self._running)) if self._running else []
            while self._queue and len(self._running) < self.max_batch:
                event = self._prefill(self._queue.popleft())
                if event is not None:
                    events.append(event)
        return events

    def pop_output(self, request_id: str) -> Output | None:
        return self._finished.pop(request_id, None)

    def pop_finished(self) -> list[Output]:
        out = list(self._finished.values())
        self._finished.clear()
        return out

    # -- the model -----------------------------------------------------------------------
    def _prefill(self, seq: _Sequence) -> TokenEvent | None:
        """Fill the cache with the prompt and sample the first token. A recompute state
        (tokens but no cache) fills prompt + tokens[:-1] and samples nothing: its last
        token is the next decode input."""
        req = seq.request
        cap = req.prompt_len + req.params.max_new_tokens
        H, Dh = self._layout.n_heads, self._layout.head_dim
        dt = self._layout.torch_dtype()
        seq.k = [torch.empty(cap, H, Dh, dtype=dt, device=self._device) for _ in range(self._layout.n_layers)]
        seq.v = [torch.empty(cap, H, Dh, dtype=dt, device=self._device) for _ in range(self._layout.n_layers)]
        context = list(req.prompt_ids) + seq.tokens[:-1]
        prompt = torch.tensor(context, dtype=torch.long, device=self._device)
        logits = None
        for start in range(0, len(context), self.prefill_chunk):
            ids = prompt[start:start + self.prefill_chunk][None]
            pos = torch.arange(start, start + ids.shape[1], device=self._device)[None]
            past = None
            if start:
                past = [(k[:start].transpose(0, 1)[None], v[:start].transpose(0, 1)[None]) for k, v in zip(seq.k, seq.v)]
            logits, new_past = self.model(ids, pos, past_kv=past, use_cache=True)
            for i, (k, v) in enumerate(new_past):
                seq.k[i][start:start + ids.shape[1]] = k[0, :, start:].transpose(0, 1)
                seq.v[i][start:start + ids.shape[1]] = v[0, :, start:].transpose(0, 1)
        seq.length = len(context)
        self._c["prefill_tokens"] += len(context)
        self._running.append(seq)
        return self._emit(seq, logits[0, -1]) if not seq.tokens else None

    def _decode(self, batch: list[_Sequence]) -> list[TokenEvent]:
        B = len(batch)
        lengths = torch.tensor([s.length for s in batch], device=self._device)
        s_max = int(lengths.max())
        H, Dh = self._layout.n_heads, self._layout.head_dim
        dt = self._layout.torch_dtype()
        past = []
        for layer in range(self._layout.n_layers):
            k = torch.zeros(B, H, s_max, Dh, dtype=dt, device=self._device)
            v = torch.zeros(B, H, s_max, Dh, dtype=dt, device=self._device)
            for b, s in enumerate(batch):
                k[b, :, :s.length] = s.k[layer][:s.length].transpose(0, 1)
                v[b, :, :s.length] = s.v[layer][:s.length].transpose(0, 1)
            past.append((k, v))
        ids = torch.tensor([[s.tokens[-1]] for s in batch], dtype=torch.long, device=self._device)
        pos = lengths[:, None]
        mask = None
        if bool((lengths != s_max).any()):
            cols = torch.arange(s_max + 1, device=self._device)
            mask = ((cols[None, :] < lengths[:, None]) | (cols[None, :] == s_max))[:, None, None, :]
        logits, new_past = self.model(ids, pos, attn_mask=mask, past_kv=past, use_cache=True)
        events = []
        for b, s in enumerate(batch):
            for layer, (k, v) in enumerate(new_past):
                s.k[layer][s.length] = k[b, :, s_max]
                s.v[layer][s.length] = v[b, :, s_max]
            s.length += 1
            self._c["decode_tokens"] += 1
            events.append(self._emit(s, logits[b, -1]))
        return events

    def _emit(self, seq: _Sequence, logits: torch.Tensor) -> TokenEvent:
        token, logprob = sample_token(logits.cpu(), seq.request.params, seq.generator)
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.policy_version = min(seq.policy_version, self._version)
        reason = None
        if token in seq.request.params.stop_token_ids:
            reason = "stop"
        elif len(seq.tokens) >= seq.request.params.max_new_tokens:
            reason = "length"
        event = TokenEvent(seq.request.request_id, token, logprob, len(seq.tokens) - 1, reason)
        if reason is not None:
            self._running.remove(seq)
            self._c["requests_finished"] += 1
            r = seq.request
            self._finished[r.request_id] = Output(
                r.request_id, r.prompt_ids, tuple(seq.tokens), tuple(seq.logprobs), reason, seq.seed,
                seq.policy_version, seq.migrations)
        return event

    # -- migration -----------------------------------------------------------------------
    def kv_export(self, request_id: str) -> KVState:
        seq = self._find(request_id)
        if seq is None:
            where = "finished (pop_output it)" if request_id in self._finished else "not in this engine"
            raise KeyError(f"engine {self.name}: request {request_id!r} is {where}; only in-flight requests export")
        if seq.prefilled:
            self._running.remove(seq)
        else:
            self._queue.remove(seq)
        kv = tuple((k[:seq.length], v[:seq.length]) for k, v in zip(seq.k, seq.v)) if seq.prefilled else ()
        self._c["migrations_out"] += 1
        return KVState(
            request=seq.request, layout=self._layout, token_ids=tuple(seq.tokens), logprobs=tuple(seq.logprobs),
            kv=kv, seed=seq.seed, rng_state=generator_state(seq.generator) if seq.generator is not None else None,
            policy_version=seq.policy_version, migrations=seq.migrations + 1, source=self.name)

    def kv_import(self, state: KVState) -> None:
        if not self._accepting:
            raise EngineError(f"engine {self.name} is draining and admits no sequences: open() first")
        self._check_usable("kv_import")
        self._layout.check_compatible(state.layout, f"KVState {state.request_id} from {state.source or '?'} "
                                                    f"into engine {self.name}")
        state.check()
        self._check_new(state.request)
        gen = None
        if not state.request.params.greedy:
            gen = generator_from_state(state.rng_state) if state.rng_state is not None \
                else torch.Generator().manual_seed(state.seed)
        seq = _Sequence(state.request, state.seed, gen, min(state.policy_version, self._version),
                        migrations=state.migrations, tokens=list(state.token_ids), logprobs=list(state.logprobs))
        self._c["migrations_in"] += 1
        if not state.prefilled:
            self._queue.append(seq)  # prefilled at the next step (recompute states included)
            return
        cap = state.request.prompt_len + state.request.params.max_new_tokens
        for k, v in state.kv:
            for src, dst in ((k, seq.k), (v, seq.v)):
                buf = torch.empty((cap,) + tuple(src.shape[1:]), dtype=src.dtype, device=self._device)
                buf[:src.shape[0]] = src
                dst.append(buf)
        seq.length = state.cached_len
        self._running.append(seq)

    def close_admission(self) -> None:
        self._accepting = False

    def open(self) -> None:
        self._check_usable("open")
        self._accepting = True

    # -- weights and memory --------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        expected = self.model.state_dict()
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing or unexpected:
            raise ValueError(f"engine {self.name}.load_weights(version={version}): missing tensors {missing[:5]}, "
                             f"unexpected tensors {unexpected[:5]}")
        for key, t in state_dict.items():
            if tuple(t.shape) != tuple(expected[key].shape):
                raise ValueError(f"engine {self.name}.load_weights(version={version}): tensor {key} has shape "
                                 f"{tuple(t.shape)}, the model needs {tuple(expected[key].shape)}")
        if self._needs_weights:
            self.model.to_empty(device=self._device)
        with torch.no_grad():
            for key, param in self.model.state_dict().items():
                param.copy_(state_dict[key])
        self._needs_weights = False
        self._version = version

    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"engine {self.name}.sleep(level={level}): valid levels are 1 (free KV) and 2 (free KV and weights)")
        inflight = self.request_ids()
        if inflight:
            raise EngineError(f"engine {self.name}.sleep(): {len(inflight)} requests in flight; drain() them first")
        if level == 2:
            # Parameters move to the meta device: their storage is released, shapes are kept
            # so load_weights can validate and re-materialise them.
            self.model.to_empty(device="meta")
            self._needs_weights = True
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = level

    def wake(self) -> None:
        self._asleep = 0

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

"""TorchEngine: continuous batching over a TinyLM with a real KV cache; the CPU reference.

Cache: ``kv_cache.SlotKVCache``, one batch-major buffer per layer in which every running
sequence owns a row. The model writes each token's key/value once, through its
``kv_cache`` hook, and batched decode attends over a view of the rows in place (sequences of
different lengths are padded by a [B, 1, 1, S] key mask, nothing is gathered or copied per
step). Sequences join (after their prefill) and leave (on a stop token or spent budget)
between iterations; a leaving sequence's row is refilled by the last row.

Prefill runs one sequence at a time in chunks of ``prefill_chunk`` tokens; each chunk
attends causally to itself and fully to the cached past without any mask (see
``kv_cache``), so a 32K prompt never builds a context-sized mask.
``max_prefill_tokens`` bounds the prompt tokens prefilled per step (vLLM's token budget):
a longer prompt fills across steps in a one-row staging cache while the batch decodes.

Exactness: each request samples from its own generator (see ``sampling``). With
``invariant=True`` (the default) every kernel has a fixed reduction order
(``models.invariant``), so a token's logprob is bit for bit the same alone or in any batch,
after a retained or migrated cache or a fresh prefill, in any prefill chunking, and equal to
the trainer's. With ``invariant=False`` (``model.numerics: native``) batch composition changes
float rounding of the logits (different matmul shapes): greedy tokens still match
one-at-a-time decoding and logprobs agree to ~1e-6. Export copies a row out
(the row is reused once the sequence leaves); import copies it into a row of the
destination, so a migrated sequence continues from bit-identical keys and values.

Retained sessions (what vLLM's automatic prefix caching and SGLang's radix cache do for agent
serving): when a request of a ``session`` finishes, its row (prompt + output[:-1]) is copied
out and kept as that session's context, one entry per session, the latest. The session's
next call, whose prompt is the previous prompt + output + tool result, writes that context
into its row and prefills only the new tokens. A prompt that shares only a prefix with it
(a retry rewinds to its anchor; after a compression the context restarts from the intro)
reuses the KV of the longest common prefix and prefills the rest, as a radix cache would: a
token's keys and values depend only on the tokens before it, so the prefix's are the ones a
full prefill would compute (bit for bit with invariant kernels). Entries are bounded by
``max_retained_tokens`` (least recently used first out) and are all dropped when the weights
change version (KV from old weights would make behaviour logprobs inexact) or on ``sleep``.
``export_session``/``import_session`` move a context with its KV when the engine is released.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from gyre_hpc.engines.base import Engine, EngineBookkeeping, EngineError, EngineLoad, outstanding_tokens_of
from gyre_hpc.engines.kv_cache import SlotKVCache
from gyre_hpc.engines.kv_state import KVLayout, KVState, generator_from_state, generator_state
from gyre_hpc.engines.pacing import EnginePace
from gyre_hpc.engines.requests import Output, Request, TokenEvent
from gyre_hpc.engines.sampling import sample_token
from gyre_hpc.models.tiny_lm import TinyLM


def common_prefix(held: tuple[int, ...], context: list[int], limit: int) -> int:
    """How many first tokens of ``context`` are ``held``'s, at most ``limit``: the part of a
    retained context a new prompt can reuse. An extension (the common case) is one tuple
    comparison; anything else finds the first difference in numpy, not a Python loop over
    thousands of tokens."""
    n = min(len(held), len(context), limit)
    if n <= 0:
        return 0
    if tuple(context[:n]) == held[:n]:
        return n
    differ = np.flatnonzero(np.asarray(held[:n], dtype=np.int64) != np.asarray(context[:n], dtype=np.int64))
    return int(differ[0])


def cache_heads(cfg) -> tuple[int, int]:
    """(kv heads, head size) the cache stores per token. A grouped-query model caches fewer
    heads than it queries; the model stack's config names them ``kv_heads`` and ``dh``
    (``head_dim`` may be None there), the byte-level TinyLM's ``n_heads`` and ``head_dim``."""
    heads = getattr(cfg, "kv_heads", None) or getattr(cfg, "n_kv_heads", None) or cfg.n_heads
    return int(heads), int(getattr(cfg, "dh", None) or cfg.head_dim)


@dataclass
class _Sequence:
    request: Request
    seed: int | None
    generator: torch.Generator | None
    policy_version: int
    migrations: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    prefilled: bool = False      # holds a row of the engine's cache
    reuse: tuple = ()            # KV of its context's first tokens: a partial prefill that moved here

    def context(self) -> list[int]:
        """The tokens its cache row holds once filled: the prompt and all but the last token
        generated (the last is the next decode input)."""
        return list(self.request.prompt_ids) + self.tokens[:-1]


@dataclass
class _Staged:
    """A sequence prefilled across steps in its own one-row cache; ``context`` is built once."""
    seq: _Sequence
    cache: SlotKVCache
    context: list[int]


class TorchEngine(EngineBookkeeping, Engine):
    def __init__(self, model: TinyLM, name: str = "torch", *, version: int = 0, max_batch: int = 32,
                 prefill_chunk: int = 4096, max_prefill_tokens: int | None = None, seed: int = 0,
                 max_retained_tokens: int = 1 << 18, invariant: bool = True, pace: EnginePace | None = None):
        if max_batch < 1:
            raise ValueError(f"TorchEngine.max_batch={max_batch} must be >= 1")
        if prefill_chunk < 1:
            raise ValueError(f"TorchEngine.prefill_chunk={prefill_chunk} must be >= 1")
        if max_prefill_tokens is not None and max_prefill_tokens < 1:
            raise ValueError(f"TorchEngine.max_prefill_tokens={max_prefill_tokens} must be >= 1 (or None: no budget)")
        if max_retained_tokens < 0:
            raise ValueError(f"TorchEngine.max_retained_tokens={max_retained_tokens} must be >= 0 (0: retain nothing)")
        self.name = name
        self.model = model.eval()
        # Batch- and cache-invariant kernels (models.invariant): a token's logprob is the same
        # alone, in any batch, after a retained or migrated cache, in any prefill chunking, and
        # equal to the trainer's under model.numerics=invariant.
        self.invariant = invariant
        # A paced engine (cells.device: paced): each step ends no earlier than the device
        # model's duration for it, and admits no more than the model's KV holds.
        self.pace = pace
        self._step_prefills: list[tuple[int, int]] = []
        self.max_retained_tokens = max_retained_tokens
        # session -> (context tokens, per-layer token-major (k, v)); least recently used first.
        self._retained: OrderedDict[str, tuple[tuple[int, ...], tuple]] = OrderedDict()
        self._retained_total = 0
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        # Prompt tokens prefilled per step; a prompt longer than what is left of the budget is
        # prefilled across steps in a one-row staging cache while the batch keeps decoding.
        self.max_prefill_tokens = max_prefill_tokens
        self._staged: _Staged | None = None
        self._version = version
        cfg = model.config
        dtype = next(model.parameters()).dtype
        n_kv_heads, head_dim = cache_heads(cfg)
        self._layout = KVLayout(cfg.n_layers, n_kv_heads, head_dim, str(dtype).removeprefix("torch."))
        self._device = next(model.parameters()).device
        # One cache row per batch slot (the cache's own default of 32 rows had a 64-wide
        # engine die at its 33rd sequence).
        self._cache = SlotKVCache(cfg.n_layers, n_kv_heads, head_dim, dtype, self._device,
                                  max_rows=max_batch, max_tokens=cfg.max_position, invariant=invariant)
        self._rows: list[_Sequence] = []   # the running sequences in cache-row order
        self._seed_source = torch.Generator().manual_seed(seed)
        self._queue: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._finished: OrderedDict[str, Output] = OrderedDict()
        self._accepting = True
        self._asleep = 0          # 0 awake, else the sleep level
        self._needs_weights = False
        self._c = dict(prefill_tokens=0, decode_tokens=0, migrations_in=0, migrations_out=0, requests_finished=0,
                       cached_prompt_tokens=0)

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None, **kwargs) -> "TorchEngine":
        """An engine over any HF-format TinyLM checkpoint directory."""
        from gyre_hpc.models.checkpoint import load_pretrained

        return cls(load_pretrained(directory, dtype=dtype), **kwargs)

    # -- state ---------------------------------------------------------------------------
    def _waiting(self) -> list[_Sequence]:
        """Not yet decoding: the sequence being prefilled across steps, then the queue."""
        return ([self._staged.seq] if self._staged is not None else []) + list(self._queue)

    def request_ids(self) -> list[str]:
        return [s.request.request_id for s in self._running] + [s.request.request_id for s in self._waiting()]

    def load(self) -> EngineLoad:
        waiting = self._waiting()
        seqs = list(self._running) + waiting
        return EngineLoad(
            queued=len(waiting), running=len(self._running),
            kv_tokens=sum(self._cache.lengths),
            outstanding_tokens=sum(outstanding_tokens_of(s.request, len(s.tokens), s.prefilled) for s in seqs))

    def _find(self, request_id: str) -> _Sequence | None:
        for s in self._running:
            if s.request.request_id == request_id:
                return s
        for s in self._waiting():
            if s.request.request_id == request_id:
                return s
        return None

    def _check_new(self, request: Request) -> None:
        rid = request.request_id
        if self._find(rid) is not None or rid in self._finished:
            raise ValueError(f"engine {self.name}: request_id {rid!r} is already in this engine")
        ids, vocab = request.prompt_ids, self.model.config.vocab_size
        # min/max run in C: a per-token Python test cost ~3 ms of a 3K-token call's ~25 ms.
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
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
        # The step's prefills, for the pace; reset on every step, paced or not, or an unpaced
        # engine keeps one record per model call for as long as it lives.
        self._step_prefills = []
        if self.pace is None:
            return self._step()
        started = self.pace.pacer.clock()
        decoding = len(self._running)
        kv = int(sum(self._cache.lengths)) if decoding else 0
        events = self._step()
        self.pace.pacer.hold(started, self.pace.step_s(decoding, kv, self._step_prefills))
        return events

    def pace_record(self) -> dict | None:
        """The paced engine's record (emulated durations, overruns); None when native."""
        return None if self.pace is None else self.pace.pacer.record.as_dict()

    def _kv_room(self, need: int) -> bool:
        """Whether the modelled KV holds ``need`` more tokens beside what is running (a
        paced engine refuses what its device could not hold; an empty engine admits)."""
        cap = self.pace.model.kv_capacity_tokens() if self.pace is not None else 0
        return not cap or not self._running or int(sum(self._cache.lengths)) + need <= cap

    def _admits(self, need: int) -> bool:
        """Whether a sequence of ``need`` context tokens may take a slot now: a free batch
        slot and room in the modelled KV (queued admission and a moved sequence alike)."""
        return len(self._running) + (self._staged is not None) < self.max_batch and self._kv_room(need)

    def _step(self) -> list[TokenEvent]:
        with torch.no_grad():
            events = self._decode() if self._running else []
            budget = self.max_prefill_tokens if self.max_prefill_tokens is not None else float("inf")
            if self._staged is not None:
                budget -= self._continue_staging(budget, events)
            while self._queue and budget > 0 and self._admits(len(self._queue[0].context())):
                seq = self._queue.popleft()
                context = seq.context()
                reuse, seq.reuse = seq.reuse or self._take_retained(seq, context), ()
                need = len(context) - (int(reuse[0][0].shape[0]) if reuse else 0)
                if need <= budget:
                    budget -= need
                    event = self._prefill(seq, context, reuse)
                    if event is not None:
                        events.append(event)
                else:
                    cache = SlotKVCache(self._layout.n_layers, self._layout.n_heads, self._layout.head_dim,
                                        self._layout.torch_dtype(), self._device,
                                        max_tokens=self.model.config.max_position, invariant=self.invariant)
                    cache.add_row(len(context) + 1)
                    if reuse:
                        cache.write(0, reuse)
                    self._staged = _Staged(seq, cache, context)
                    budget -= self._continue_staging(budget, events)
        return events

    # -- the model -----------------------------------------------------------------------
    def _prefill(self, seq: _Sequence, context: list[int], reuse: tuple = ()) -> TokenEvent | None:
        """Fill a cache row with ``context`` (``seq.context()``) and sample the first token. A
        recompute state (tokens but no cache) samples nothing: its last token is the next
        decode input. ``reuse``: a retained context's KV for the first tokens of the prompt,
        written into the row; only the rest is run through the model."""
        row = self._add_row(seq, len(context) + 1)
        if reuse:
            self._cache.write(row, reuse)
        logits = self._fill(self._cache, row, context, self._cache.lengths[row], len(context))
        return self._emit(seq, logits[0, -1]) if not seq.tokens else None

    def _fill(self, cache: SlotKVCache, row: int, context: list[int], start: int, end: int) -> torch.Tensor:
        """Run context[start:end] through the model into ``row``, ``prefill_chunk`` tokens a
        forward; returns the last forward's logits."""
        ids_all = torch.tensor(context[start:end], dtype=torch.long, device=self._device)
        logits = None
        for at in range(start, end, self.prefill_chunk):
            ids = ids_all[at - start:at - start + self.prefill_chunk][None]
            pos = torch.arange(at, at + ids.shape[1], device=self._device)[None]
            hook = cache.prefill(row, ids.shape[1])
            logits = self.model(ids, pos, kv_cache=hook, invariant=self.invariant)
            hook.commit()
        self._c["prefill_tokens"] += end - start
        self._step_prefills.append((end - start, start))
        return logits

    def _continue_staging(self, budget: float, events: list[TokenEvent]) -> int:
        """Prefill up to ``budget`` more tokens of the staged sequence; once its context is in,
        its row moves into the batch's cache (one copy) and it samples its first token.
        Returns the tokens used."""
        seq, cache, context = self._staged.seq, self._staged.cache, self._staged.context
        done = cache.lengths[0]
        end = int(min(len(context), done + budget))
        logits = self._fill(cache, 0, context, done, end)
        if end == len(context):
            self._staged = None
            row = self._add_row(seq, end + 1)
            self._cache.write(row, cache.read(0))
            if not seq.tokens:
                events.append(self._emit(seq, logits[0, -1]))
        return end - done

    def _decode(self) -> list[TokenEvent]:
        batch = list(self._rows)
        ids = torch.tensor([[s.tokens[-1]] for s in batch], dtype=torch.long, device=self._device)
        hook = self._cache.decode()
        logits = self.model(ids, hook.pos[:, None], kv_cache=hook, invariant=self.invariant)   # each row's position is its length
        hook.commit()
        self._c["decode_tokens"] += len(batch)
        last = logits[:, -1]
        # Greedy rows are picked for the whole batch at once, by the rule of sample_token
        # (argmax of the logits, logprob from float32 log_softmax): one op, not one per row.
        greedy = [b for b, s in enumerate(batch) if s.request.params.greedy]
        picks = {}
        if greedy:
            rows = last[greedy]
            tokens = rows.argmax(-1)
            logprobs = torch.log_softmax(rows.float(), -1).gather(1, tokens[:, None])[:, 0]
            picks = dict(zip(greedy, zip(tokens.tolist(), logprobs.tolist())))
        return [self._emit(s, last[b], picks.get(b)) for b, s in enumerate(batch)]

    def _add_row(self, seq: _Sequence, tokens: int) -> int:
        # Room for twice what it holds now, up to the request's own bound: decoding then
        # rarely regrows the cache, and a large budget does not reserve memory up front.
        bound = seq.request.prompt_len + seq.request.params.max_new_tokens
        row = self._cache.add_row(max(tokens, min(bound, 2 * tokens)))
        self._rows.append(seq)
        self._running.append(seq)
        seq.prefilled = True
        return row

    def _remove_row(self, seq: _Sequence) -> None:
        """Free the sequence's row; the cache moves its last row there, and so do we."""
        row = self._rows.index(seq)
        self._cache.remove_row(row)
        last = self._rows.pop()
        if last is not seq:
            self._rows[row] = last
        self._running.remove(seq)

    def _emit(self, seq: _Sequence, logits: torch.Tensor, picked: tuple[int, float] | None = None) -> TokenEvent:
        token, logprob = picked or sample_token(logits.cpu(), seq.request.params, seq.generator)
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
            if seq.request.session is not None:
                self._retain(seq)
            self._remove_row(seq)
            self._c["requests_finished"] += 1
            r = seq.request
            self._finished[r.request_id] = Output(
                r.request_id, r.prompt_ids, tuple(seq.tokens), tuple(seq.logprobs), reason, seq.seed,
                seq.policy_version, seq.migrations)
        return event

    # -- retained sessions ---------------------------------------------------------------
    def _retain(self, seq: _Sequence) -> None:
        """Keep a finishing sequence's row as its session's context (a copy: the row is reused)."""
        row = self._rows.index(seq)
        context = tuple(seq.context())
        if self._cache.lengths[row] != len(context):
            raise EngineError(f"engine {self.name}: request {seq.request.request_id} holds {self._cache.lengths[row]} "
                              f"cached tokens for a context of {len(context)}")
        self._keep(seq.request.session, context, self._cache.read(row) if len(context) <= self.max_retained_tokens else ())

    def _keep(self, session: str, context: tuple[int, ...], kv: tuple) -> None:
        self.drop_session(session)
        if not kv or len(context) > self.max_retained_tokens:
            return
        self._retained[session] = (context, kv)
        self._retained_total += len(context)
        while self._retained_total > self.max_retained_tokens:
            _, (old, _) = self._retained.popitem(last=False)
            self._retained_total -= len(old)

    def _take_retained(self, seq: _Sequence, context: list[int]) -> tuple:
        """The KV of the session's retained context for the longest prefix ``context``
        shares with it (the entry leaves the store: the request will leave a newer one), or
        () when there is none or nothing is shared. At least the last context token is left
        to compute: its logits sample the first token."""
        session = seq.request.session
        if session is None or session not in self._retained:
            return ()
        tokens, kv = self._retained[session]
        self.drop_session(session)
        n = common_prefix(tokens, context, len(context) - 1)
        if n < 1:
            return ()
        self._c["cached_prompt_tokens"] += n
        return tuple((k[:n], v[:n]) for k, v in kv)

    def retained_sessions(self) -> list[str]:
        return list(self._retained)

    @property
    def retained_tokens(self) -> int:
        return self._retained_total

    def drop_session(self, session: str) -> bool:
        entry = self._retained.pop(session, None)
        if entry is not None:
            self._retained_total -= len(entry[0])
        return entry is not None

    def _drop_retained(self) -> None:
        self._retained.clear()
        self._retained_total = 0

    def export_session(self, session: str) -> KVState:
        if session not in self._retained:
            raise KeyError(f"engine {self.name}: no retained context for session {session!r}; "
                           f"it holds {len(self._retained)} sessions")
        tokens, kv = self._retained[session]
        self.drop_session(session)
        return KVState(request=Request(session, tokens, session=session), layout=self._layout, kv=kv,
                       policy_version=self._version, source=self.name, retained=True)

    def import_session(self, state: KVState) -> None:
        """A context computed under other weights is not kept (its next call prefills in full)."""
        self._check_usable("import_session")
        self._layout.check_compatible(state.layout, f"retained context {state.request_id} from "
                                                    f"{state.source or '?'} into engine {self.name}")
        if not state.retained:
            raise ValueError(f"engine {self.name}.import_session: KVState {state.request_id} is an in-flight "
                             f"sequence, not a retained context (kv_import it)")
        state.check()
        if state.policy_version == self._version:
            self._keep(state.request.session, state.request.prompt_ids,
                       tuple((k.to(self._device), v.to(self._device)) for k, v in state.kv))

    # -- migration -----------------------------------------------------------------------
    def kv_export(self, request_id: str) -> KVState:
        seq = self._find(request_id)
        if seq is None:
            where = "finished (pop_output it)" if request_id in self._finished else "not in this engine"
            raise KeyError(f"engine {self.name}: request {request_id!r} is {where}; only in-flight requests export")
        kv = ()
        if seq.prefilled:
            kv = self._cache.read(self._rows.index(seq))
            self._remove_row(seq)
        elif self._staged is not None and seq is self._staged.seq:
            # a partial prefill travels: the destination fills only the rest
            if self._staged.cache.lengths[0] > 0:
                kv = self._staged.cache.read(0)
            self._staged = None
        else:
            self._queue.remove(seq)
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
        if not state.prefilled or state.partial or not self._admits(state.cached_len):
            # Prefilled at the next step (recompute states included); a partial prefill's KV
            # is written into its row there and only the rest of its context runs. A full
            # engine (every slot, or the paced device's KV) queues a moved sequence with its
            # whole KV: it takes the next free slot without recomputing anything.
            seq.reuse = tuple((k.to(self._device), v.to(self._device)) for k, v in state.kv)
            self._queue.append(seq)
            return
        row = self._add_row(seq, state.cached_len + 1)
        self._cache.write(row, [(k.to(self._device), v.to(self._device)) for k, v in state.kv])

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
        self._drop_retained()

    def adopt_weights(self, version: int) -> None:
        if version != self._version:
            self._drop_retained()
        super().adopt_weights(version)

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
        self._drop_retained()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self._asleep = level

    def wake(self) -> None:
        self._asleep = 0

    @property
    def asleep(self) -> bool:
        return bool(self._asleep)

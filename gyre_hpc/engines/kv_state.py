"""A sequence's full decoding state, as it leaves one engine and enters another.

Why this much: continuing bit-exactly on another engine needs the KV cache (so nothing is
recomputed), the tokens and logprobs so far (the output is one record however often the
sequence moved), the sampler's generator state (so a seeded draw continues the same
stream) and the request itself (budget, stop ids). Anything less and the destination would
either re-prefill or sample a different continuation.

Cache convention shared by every engine: ``kv`` holds the keys/values of the prompt and of
every output token except the last one, which has been sampled but not yet fed back
through the model. So ``cached_len == prompt_len + len(token_ids) - 1`` once prefilled, and
a state that was never prefilled has no ``kv`` and no tokens. A state with tokens but no
``kv`` is a *recompute* state (an engine that cannot hand out its cache, e.g. vLLM without a
KV connector): the destination re-prefills prompt + tokens[:-1], then continues. Tensors are token-major,
[cached_len, n_heads, head_dim] (the model's [B, H, S, Dh] with B dropped and S first):
a prefix of a token-major buffer is contiguous, so exporting a cache is a view, not a copy,
and a transport can stream it in chunks straight from the engine's memory.

A session's *retained context* (an agent context an engine keeps between calls, see
``TorchEngine``) travels as a KVState too, with ``retained=True``: its request carries the
session and the context as ``prompt_ids``, it has no tokens, and ``kv`` covers the whole
context (``cached_len == prompt_len``). It is not a sequence to continue but a cache to keep.

The wire form (``to_wire``/``from_wire``) is a small picklable header plus a list of
contiguous tensors, so a transport can move the bulk as raw buffers (MPI Send/Recv) without
pickling megabytes of cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gyre_hpc.engines.requests import Request, SamplingParams


@dataclass(frozen=True)
class KVLayout:
    """The cache's shape per token; an engine refuses a state whose layout differs from its own."""

    n_layers: int
    n_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"

    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"KVLayout.dtype={self.dtype!r} is not a torch dtype name")
        return dt

    def check_compatible(self, state_layout: "KVLayout", what: str) -> None:
        """Raise ValueError naming each field where ``state_layout`` differs from this engine's."""
        diff = [f"{f}={getattr(state_layout, f)} (engine has {getattr(self, f)})"
                for f in ("n_layers", "n_heads", "head_dim", "dtype") if getattr(state_layout, f) != getattr(self, f)]
        if diff:
            raise ValueError(f"{what}: KV layout differs: {', '.join(diff)}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_heads * self.head_dim * torch.empty((), dtype=self.torch_dtype()).element_size()


@dataclass(frozen=True)
class KVState:
    request: Request
    layout: KVLayout
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    # Per layer (k, v), each [cached_len, n_heads, head_dim]; empty before prefill.
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    seed: int | None = None
    rng_state: bytes | None = None   # torch.Generator.get_state() bytes; None for greedy
    policy_version: int = 0
    migrations: int = 0
    source: str = ""                 # engine that exported it, for logs
    retained: bool = False           # a session's retained context, not an in-flight sequence

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prefilled(self) -> bool:
        return bool(self.kv)

    @property
    def cached_len(self) -> int:
        return int(self.kv[0][0].shape[0]) if self.kv else 0

    @property
    def context_len(self) -> int:
        """Tokens whose KV a continuing engine needs: the prompt and every sampled token but
        the last (the next decode input)."""
        return self.request.prompt_len + max(len(self.token_ids) - 1, 0)

    @property
    def partial(self) -> bool:
        """A sequence exported in the middle of a budgeted prefill: ``kv`` covers the first
        ``cached_len`` tokens of its context; the destination prefills the rest only."""
        return bool(self.kv) and not self.retained and self.cached_len < self.context_len

    @property
    def remaining_tokens(self) -> int:
        return self.request.params.max_new_tokens - len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    def check(self) -> None:
        """Raise ValueError naming the field if the state is not one an engine can continue."""
        rid = self.request_id
        if self.retained:
            self._check_retained()
            return
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"KVState {rid}: {len(self.logprobs)} logprobs for {len(self.token_ids)} token_ids")
        if self.remaining_tokens < 0:
            raise ValueError(f"KVState {rid}: token_ids has {len(self.token_ids)} tokens, more than "
                             f"max_new_tokens={self.request.params.max_new_tokens}")
        if not self.kv:
            return  # never prefilled, or a state whose cache did not travel (the destination recomputes it)
        if self.partial:
            self._check_kv(self.cached_len, "cached_len")   # layers, heads, dtype
            return
        if not self.token_ids:
            raise ValueError(f"KVState {rid}: has a kv cache but no token_ids; the first token is sampled at prefill")
        self._check_kv(self.context_len, "prompt_len + len(token_ids) - 1")

    def _check_retained(self) -> None:
        rid = self.request_id
        if self.request.session is None:
            raise ValueError(f"KVState {rid}: a retained context needs request.session")
        if self.token_ids or not self.kv:
            raise ValueError(f"KVState {rid}: a retained context has kv and no token_ids "
                             f"(got {len(self.token_ids)} tokens, {len(self.kv)} kv layers)")
        self._check_kv(self.request.prompt_len, "prompt_len")

    def _check_kv(self, want_len: int, rule: str) -> None:
        rid = self.request_id
        if len(self.kv) != self.layout.n_layers:
            raise ValueError(f"KVState {rid}: kv has {len(self.kv)} layers, layout.n_layers={self.layout.n_layers}")
        want = (want_len, self.layout.n_heads, self.layout.head_dim)
        for i, (k, v) in enumerate(self.kv):
            for name, t in (("k", k), ("v", v)):
                if tuple(t.shape) != want:
                    raise ValueError(f"KVState {rid}: kv[{i}].{name} has shape {tuple(t.shape)}, expected {want} "
                                     f"({rule}, heads, head_dim)")
                if t.dtype != self.layout.torch_dtype():
                    raise ValueError(f"KVState {rid}: kv[{i}].{name} is {t.dtype}, layout.dtype={self.layout.dtype}")


def generator_state(gen: torch.Generator) -> bytes:
    return gen.get_state().numpy().tobytes()


def generator_from_state(state: bytes) -> torch.Generator:
    gen = torch.Generator()
    gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return gen


# ---- wire form -------------------------------------------------------------------------


def to_wire(state: KVState) -> tuple[dict, list[torch.Tensor]]:
    """Header (small, picklable) and the tensors to move as raw bytes, in a fixed order."""
    p = state.request.params
    header = {
        "request_id": state.request.request_id,
        "prompt_ids": list(state.request.prompt_ids),
        "session": state.request.session,
        "params": {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
                   "seed": p.seed, "stop_token_ids": list(p.stop_token_ids)},
        "layout": {"n_layers": state.layout.n_layers, "n_heads": state.layout.n_heads,
                   "head_dim": state.layout.head_dim, "dtype": state.layout.dtype},
        "token_ids": list(state.token_ids),
        "logprobs": list(state.logprobs),
        "cached_len": state.cached_len,
        "seed": state.seed,
        "rng_state": state.rng_state,
        "policy_version": state.policy_version,
        "migrations": state.migrations,
        "source": state.source,
        "retained": state.retained,
    }
    tensors = [t.contiguous() for kv in state.kv for t in kv]
    return header, tensors


def alloc_wire(header: dict) -> list[torch.Tensor]:
    """Empty tensors that ``to_wire`` of the described state would have produced."""
    lay = KVLayout(**header["layout"])
    n = header["cached_len"]
    if n == 0:
        return []
    shape = (n, lay.n_heads, lay.head_dim)
    return [torch.empty(shape, dtype=lay.torch_dtype()) for _ in range(2 * lay.n_layers)]


def from_wire(header: dict, tensors: list[torch.Tensor]) -> KVState:
    request = Request(header["request_id"], tuple(header["prompt_ids"]), SamplingParams(
        **{**header["params"], "stop_token_ids": tuple(header["params"]["stop_token_ids"])}),
        session=header["session"])
    kv = tuple((tensors[2 * i], tensors[2 * i + 1]) for i in range(len(tensors) // 2))
    state = KVState(
        request=request, layout=KVLayout(**header["layout"]), token_ids=tuple(header["token_ids"]),
        logprobs=tuple(header["logprobs"]), kv=kv, seed=header["seed"], rng_state=header["rng_state"],
        policy_version=header["policy_version"], migrations=header["migrations"], source=header["source"],
        retained=header["retained"])
    state.check()
    return state

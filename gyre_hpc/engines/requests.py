"""What goes into an engine and what comes out: small frozen dataclasses at the boundary.

Why frozen and plain: a request crosses processes (router on the controller rank, engine on
a cell rank, harness in between), so it must pickle, compare by value and never be mutated
behind a sender's back. Token ids are tuples of ints for the same reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from gyre_hpc.models.tiny_lm import EOS_ID


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token.

    ``temperature == 0`` is greedy (argmax). Otherwise tokens are drawn from
    softmax(logits / temperature), restricted to the nucleus ``top_p``, with a generator
    seeded by ``seed`` and private to the request, so a request's tokens do not depend on
    which other requests share its batch. ``seed=None`` lets the engine pick one (recorded
    in the output) so the run can still be replayed.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = (EOS_ID,)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One model call: continue ``prompt_ids`` under ``params``.

    ``session`` names the agent context the call continues (the RL path: ``<run id>/<agent>``;
    None: no reuse). An engine that retains contexts keeps the session's KV after the call,
    and the next call of the session, whose prompt extends the previous prompt + output,
    prefills only its new tokens.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"Request.request_id={self.request_id!r} must be a non-empty string")
        ids = tuple(map(int, self.prompt_ids))
        if not ids:
            raise ValueError(f"Request {self.request_id}: prompt_ids is empty; a prompt needs at least one token (BOS)")
        object.__setattr__(self, "prompt_ids", ids)
        if self.session is not None and (not isinstance(self.session, str) or not self.session):
            raise ValueError(f"Request {self.request_id}: session={self.session!r} must be a non-empty string or None")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one request, as ``Engine.step`` streams it.

    ``logprob`` is the token's log-probability under the model at temperature 1 (the
    untempered policy the trainer's importance ratio is taken against), whatever the
    sampling temperature. ``index`` counts output tokens of the request from 0.
    """

    request_id: str
    token_id: int
    logprob: float
    index: int
    finish_reason: str | None = None  # "stop" (a stop token), "length" (budget spent), None (more to come)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Output:
    """A finished request: everything the harness journal records of one model call."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    seed: int | None
    policy_version: int      # oldest weights version that produced any of its tokens
    migrations: int = 0      # times the sequence moved between engines mid-decode


@dataclass(frozen=True)
class EngineCounters:
    """Cumulative work counters. ``prefill_tokens`` counts tokens run through the model to
    fill a KV cache; a sequence migrated with its cache must not add to the destination's
    count. ``recomputed_tokens`` is the part of ``prefill_tokens`` spent re-filling the cache
    of imported sequences whose cache did not move (0 for an exact-migration engine).
    ``cached_prompt_tokens`` counts prompt tokens served from a session's retained context
    (not run through the model, so not in ``prefill_tokens``)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    migrations_in: int = 0
    migrations_out: int = 0
    requests_finished: int = 0
    recomputed_tokens: int = 0
    cached_prompt_tokens: int = 0

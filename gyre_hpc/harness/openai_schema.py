"""The OpenAI request bodies the endpoint accepts, and its errors, in OpenAI's shapes.

Why pydantic with ``extra="forbid"``: a scaffold that sends a field we do not honour (``n``,
``logit_bias``, ...) must hear so by name, not get a reply that silently ignored it; the error
body is OpenAI's (``{"error": {"message", "type", "param", "code"}}``) so the scaffold's client
raises its usual exception with the reason. Sampling fields (``temperature``, ``top_p``,
``seed``) are accepted and not applied: the policy's sampling is the training run's (the
behaviour logprobs the loss divides by are taken under it), as ``EngineCalls`` sets it.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An OpenAI-style error: an HTTP status and the four fields of its body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(_Strict):
    """The fields both endpoints take. ``temperature``, ``top_p`` and ``seed`` are accepted so
    that a scaffold's usual request passes, and not applied: sampling is the training run's."""
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: Literal[1] = 1
    user: str | None = None

    @property
    def budget(self) -> int | None:
        return self.max_tokens


class ChatRequest(_Request):
    messages: list[dict] = Field(min_length=1)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)   # only the sampled token's logprob is kept
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: list[int] = Field(min_length=1)
    stream: Literal[False] = False
    logprobs: int | None = Field(default=None, ge=0, le=1)
    echo: Literal[False] = False


def parse_body(raw: bytes, schema: type[_Strict]) -> ChatRequest | CompletionRequest:
    """The request body as ``schema``; bad JSON or a bad field is a 400 that names it."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            valid = ", ".join(schema.model_fields)
            raise APIError(400, f"Unrecognized request argument supplied: {param} (valid: {valid})", param=param,
                           code="unknown_parameter") from None
        raise APIError(400, f"Invalid value for {param}: {err['msg']}", param=param, code="invalid_value") from None

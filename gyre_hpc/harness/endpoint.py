"""The OpenAI-compatible endpoint: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

Why FastAPI: outside scaffolds speak the OpenAI API through whatever client they ship (openai,
litellm, raw HTTP), SSE included; a well-kept ASGI stack gets the protocol details right and
uvicorn serves it on the controller's event loop, the one ``EngineCalls`` steps engines on.

Per request: find the session (``endpoint_sessions``), plan its prompt against the session's
calls (``session_context``), call the session's model client (``complete(prompt ids,
max_new_tokens, stop) -> ids, logprobs``: ``EngineCalls``'s ``RunClient`` in tests, the router's
``CountingRunClient`` during rollout: ``rl.rollouts``), journal the call as the engine saw it, reply. Every failure of one request is an
OpenAI error body for that request alone. Time in the endpoint, the engine's excluded, is
kept per call (``SessionStats.overhead_s``).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyre_hpc.harness.actions import split_tool_calls
from gyre_hpc.harness.chat_render import ChatRenderer, ChatTemplateError
from gyre_hpc.harness.endpoint_sessions import Session, SessionRegistry
from gyre_hpc.harness.openai_schema import APIError, ChatRequest, CompletionRequest, parse_body
from gyre_hpc.harness.session_context import SessionCall, normalize_message, plan_prompt

SESSION_HEADER = "x-gyre-session"


def _session(registry: SessionRegistry, request: Request) -> Session:
    key = request.headers.get(SESSION_HEADER)
    if key is not None:
        session = registry.get(key)
        if session is None:
            raise APIError(404, f"no open session {key!r} (the {SESSION_HEADER} header names a run the "
                                f"controller opened)", param=SESSION_HEADER, code="session_not_found")
        return session
    auth = request.headers.get("authorization", "")
    if not auth.lower().startswith("bearer ") or not auth[7:].strip():
        raise APIError(401, "no session key: send 'Authorization: Bearer <session key>' or an "
                            f"{SESSION_HEADER} header", type="invalid_request_error", code="invalid_api_key")
    session = registry.get(auth[7:].strip())
    if session is None:
        raise APIError(401, "Incorrect API key provided: it names no open session", type="invalid_request_error",
                       code="invalid_api_key")
    return session


def _budget(requested: int | None, prompt_len: int, context_window: int, default: int) -> int:
    room = context_window - prompt_len
    if room < 1 or requested is not None and requested > room:
        asked = prompt_len + (requested or 1)
        raise APIError(400, f"This model's maximum context length is {context_window} tokens. However, you requested "
                            f"{asked} tokens ({prompt_len} in the messages, {requested or 1} in the completion). "
                            f"Please reduce the length of the messages or completion.", param="messages",
                       code="context_length_exceeded")
    return min(requested or default, room)


def _finish_reason(output: Sequence[int], stop: Sequence[int], budget: int) -> str:
    return "stop" if output and output[-1] in stop and len(output) <= budget else "length"


def create_app(registry: SessionRegistry, renderer: ChatRenderer, *, model_name: str, context_window: int,
               default_max_tokens: int = 256, max_tokens_limit: int | None = None) -> FastAPI:
    """The app over ``registry``'s sessions; prompts past ``context_window`` tokens are refused.
    ``max_tokens_limit``: a request's ``max_tokens`` is cut to it (rollout.max_new_tokens: the
    scaffold asks for what its own model would get; the run samples what the rollout allows)."""
    if context_window < 2 or default_max_tokens < 1 or max_tokens_limit is not None and max_tokens_limit < 1:
        raise ValueError(f"create_app: context_window={context_window} must be >= 2, "
                         f"default_max_tokens={default_max_tokens} >= 1 and max_tokens_limit={max_tokens_limit} >= 1")
    app = FastAPI(title="gyre-hpc endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    tok = renderer.tokenizer
    stop = tok.stop_ids()
    eos = tok.eos_id

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def _internal(_request: Request, exc: Exception):   # one request fails, the server goes on
        return JSONResponse(APIError(500, f"{type(exc).__name__}: {exc}", type="server_error").body(), status_code=500)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "gyre-hpc"}]}

    def _asked(requested: int | None) -> int | None:
        return requested if requested is None or max_tokens_limit is None else min(requested, max_tokens_limit)

    async def _generate(session: Session, prompt: Sequence[int], budget: int):
        session.admit()
        t = time.perf_counter()
        try:
            comp = await asyncio.wait_for(session.client.complete(prompt, budget, stop), session.time_left())
        except asyncio.TimeoutError:
            raise APIError(408, f"run {session.run_id}'s wall clock ran out during this call", type="timeout_error",
                           code="run_timeout") from None
        return comp, time.perf_counter() - t

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        t0 = time.perf_counter()
        session = _session(registry, request)
        body = parse_body(await request.body(), ChatRequest)
        async with session.lock:
            try:
                plan = plan_prompt(renderer, session.chat_calls, body.messages, tools=body.tools,
                                   tool_choice=body.tool_choice)
            except ChatTemplateError as exc:
                raise APIError(400, str(exc), param="messages", code="invalid_messages") from None
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages", code="invalid_messages") from None
            budget = _budget(_asked(body.budget), len(plan.prompt), context_window, default_max_tokens)
            comp, engine_s = await _generate(session, plan.prompt, budget)
            output = tuple(int(t) for t in comp.output)
            content = renderer.decode(output[:-1] if output and output[-1] == eos else output)
            reply, tool_calls = {"role": "assistant", "content": content}, []
            if body.tools:
                content, parsed = split_tool_calls(content)
                tool_calls = [{"id": f"call_{session.run_id}_{session.stats.calls}_{i}", "type": "function",
                               "function": {"name": name, "arguments": arguments}}
                              for i, (name, arguments) in enumerate(parsed)]
                if tool_calls:
                    reply = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
            call = SessionCall(tuple(normalize_message(m) for m in body.messages), normalize_message(reply),
                               plan.prompt, output)
            k = session.record_chat(plan, call, comp.logprobs, comp.policy_version)
        finish = "tool_calls" if tool_calls else _finish_reason(output, stop, budget)
        cid, created = f"chatcmpl-{session.run_id}-{k}", int(time.time())
        usage = {"prompt_tokens": len(plan.prompt), "completion_tokens": len(output),
                 "total_tokens": len(plan.prompt) + len(output)}
        head = {"id": cid, "created": created, "model": body.model, "system_fingerprint": None}
        if body.stream:
            chunks = _stream_chunks(renderer, head, output, comp.logprobs, content, finish, body.logprobs,
                                    usage if (body.stream_options or {}).get("include_usage") else None, tool_calls)
            session.stats.engine_s.append(engine_s)
            session.stats.overhead_s.append(time.perf_counter() - t0 - engine_s)
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        logprobs = {"content": _token_logprobs(renderer, output, comp.logprobs)} if body.logprobs else None
        reply_body = {**head, "object": "chat.completion",
                      "choices": [{"index": 0, "message": reply, "logprobs": logprobs, "finish_reason": finish}],
                      "usage": usage}
        data = json.dumps(reply_body)
        session.stats.engine_s.append(engine_s)
        session.stats.overhead_s.append(time.perf_counter() - t0 - engine_s)
        return Response(data, media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        t0 = time.perf_counter()
        session = _session(registry, request)
        body = parse_body(await request.body(), CompletionRequest)
        bad = [t for t in body.prompt if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary 0..{tok.vocab_size - 1}",
                           param="prompt", code="invalid_value")
        budget = _budget(_asked(body.budget), len(body.prompt), context_window, default_max_tokens)
        async with session.lock:
            comp, engine_s = await _generate(session, body.prompt, budget)
            output = tuple(int(t) for t in comp.output)
            k = session.record_tokens(body.prompt, output, comp.logprobs, comp.policy_version)
        logprobs = None
        if body.logprobs is not None:
            logprobs = {"tokens": [renderer.decode([t]) for t in output], "token_logprobs": [float(x) for x in comp.logprobs],
                        "top_logprobs": None, "text_offset": None}
        data = json.dumps({"id": f"cmpl-{session.run_id}-{k}", "object": "text_completion", "created": int(time.time()),
                           "model": body.model,
                           "choices": [{"index": 0, "text": renderer.decode(output), "token_ids": list(output),
                                        "logprobs": logprobs, "finish_reason": _finish_reason(output, stop, budget)}],
                           "usage": {"prompt_tokens": len(body.prompt), "completion_tokens": len(output),
                                     "total_tokens": len(body.prompt) + len(output)}})
        session.stats.engine_s.append(engine_s)
        session.stats.overhead_s.append(time.perf_counter() - t0 - engine_s)
        return Response(data, media_type="application/json")

    return app


def _token_logprobs(renderer: ChatRenderer, output: Sequence[int], logprobs: Sequence[float]) -> list[dict]:
    out = []
    for t, lp in zip(output, logprobs):
        text = renderer.decode([t])
        out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode("utf-8")), "top_logprobs": []})
    return out


def _stream_chunks(renderer: ChatRenderer, head: dict, output: Sequence[int], logprobs: Sequence[float], content: str,
                   finish: str, with_logprobs: bool, usage: dict | None, tool_calls: list[dict]) -> list[str]:
    """SSE events of a finished call, one per sampled token. Each token's text is the growth of
    the content's decoded prefix (a token that ends inside a UTF-8 character adds nothing until
    the character completes), so the deltas join to exactly the non-streamed content. A reply
    with tool calls streams its content whole, then its calls, as OpenAI's deltas do."""
    def event(choice: dict, **extra) -> str:
        return "data: " + json.dumps({**head, "object": "chat.completion.chunk", "choices": [choice], **extra}) + "\n\n"

    events = [event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})]
    if tool_calls:
        entries = _token_logprobs(renderer, output, logprobs) if with_logprobs else None
        events.append(event({"index": 0, "delta": {"content": content or None,
                                                   "tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]},
                             "logprobs": {"content": entries} if entries else None, "finish_reason": None}))
        events.append(event({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}))
        if usage is not None:
            events.append("data: " + json.dumps({**head, "object": "chat.completion.chunk", "choices": [],
                                                 "usage": usage}) + "\n\n")
        return events + ["data: [DONE]\n\n"]
    emitted = 0
    entries = _token_logprobs(renderer, output, logprobs) if with_logprobs else None
    for i in range(len(output)):
        text = renderer.decode(output[:i + 1])
        upto = len(text) if content.startswith(text) and not text.endswith("\ufffd") else emitted
        upto = max(emitted, min(upto, len(content)))
        if i == len(output) - 1:
            upto = len(content)
        delta, emitted = content[emitted:upto], upto
        events.append(event({"index": 0, "delta": {"content": delta},
                             "logprobs": {"content": [entries[i]]} if entries else None, "finish_reason": None}))
    if emitted < len(content):
        events.append(event({"index": 0, "delta": {"content": content[emitted:]}, "logprobs": None,
                             "finish_reason": None}))
    events.append(event({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}))
    if usage is not None:
        events.append("data: " + json.dumps({**head, "object": "chat.completion.chunk", "choices": [],
                                             "usage": usage}) + "\n\n")
    events.append("data: [DONE]\n\n")
    return events

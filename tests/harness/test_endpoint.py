"""The OpenAI-compatible endpoint served for real: uvicorn on 127.0.0.1, the ``openai`` client,
TorchEngine over a tiny decoder through ``EngineCalls``, journals on disk read back."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch

openai = pytest.importorskip("openai", reason="openai is not installed (the test extra)")
uvicorn = pytest.importorskip("uvicorn", reason="uvicorn is not installed (the endpoint extra)")

from gyre_hpc.engines.torch_engine import TorchEngine  # noqa: E402
from gyre_hpc.harness.chat_render import ChatRenderer  # noqa: E402
from gyre_hpc.harness.endpoint import create_app  # noqa: E402
from gyre_hpc.harness.endpoint_sessions import SessionRegistry  # noqa: E402
from gyre_hpc.harness.engine_client import EngineCalls  # noqa: E402
from gyre_hpc.harness.journal import load_journal  # noqa: E402
from gyre_hpc.models.tiny_lm import build_model  # noqa: E402
from gyre_hpc.models.tokenizer import embedded_tokenizer  # noqa: E402
from gyre_hpc.trees.builder import build_tree  # noqa: E402

MODEL = "gyre-tiny"
WINDOW = 2048
SYS = {"role": "system", "content": "be brief"}


def _sharp_model():
    """The tiny preset with weights x10: peaked, context-dependent predictions (as the engine tests')."""
    model = build_model("tiny", seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(10.0)
    return model


class Served:
    def __init__(self, tmp_path):
        torch.set_num_threads(1)
        self.tmp = tmp_path
        self.calls = EngineCalls(TorchEngine(_sharp_model()), temperature=1.0)
        self.registry = SessionRegistry()
        self.app = create_app(self.registry, ChatRenderer(embedded_tokenizer()), model_name=MODEL,
                              context_window=WINDOW, default_max_tokens=8)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start in 20 s"
            time.sleep(0.02)

    def session(self, name: str, seed: int = 0):
        s = self.registry.open(name, self.calls.client(seed), self.tmp / f"{name}.journal")
        return s, openai.OpenAI(base_url=self.url, api_key=s.key, max_retries=0)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(tmp_path_factory.mktemp("endpoint"))
    yield s
    s.stop()


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **kw)


def test_three_turns_journal_the_sampled_tokens_verbatim_in_the_next_prompt(served):
    session, client = served.session("three")
    messages = [SYS, {"role": "user", "content": "turn one"}]
    replies = []
    for turn in ("turn two", "turn three", None):
        r = _chat(client, messages, logprobs=True)
        replies.append(r)
        if turn is not None:
            messages = messages + [r.choices[0].message.model_dump(), {"role": "user", "content": turn}]
    journal = load_journal(session.journal.path)
    assert len(journal.calls) == 3
    for k in (1, 2):
        prev = journal.calls[k - 1]
        inc = journal.calls.increments[k]
        assert (inc.base, inc.shared) == (k - 1, prev.prompt.size + prev.output.size)
        assert np.array_equal(journal.calls[k].prompt[:inc.shared], np.concatenate([prev.prompt, prev.output]))
    for r, call in zip(replies, journal.calls):
        lps = [c.logprob for c in r.choices[0].logprobs.content]
        assert np.array_equal(np.asarray(lps, np.float32), call.logprobs)
        assert r.usage.prompt_tokens == call.prompt.size and r.usage.completion_tokens == call.output.size
    assert session.stats.as_dict()["extends"] == 2 and session.stats.drift == 0
    tree = build_tree(list(journal.calls))
    assert int(tree.trained.sum()) == sum(c.output.size for c in journal.calls)


def test_streaming_equals_non_streaming(served):
    _, plain = served.session("plain", seed=7)
    _, streamed = served.session("streamed", seed=7)
    messages = [SYS, {"role": "user", "content": "stream this"}]
    whole = _chat(plain, messages, logprobs=True)
    pieces, lps, finish = [], [], None
    for chunk in _chat(streamed, messages, logprobs=True, stream=True):
        choice = chunk.choices[0]
        pieces.append(choice.delta.content or "")
        lps += [c.logprob for c in (choice.logprobs.content if choice.logprobs else [])]
        finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content
    assert lps == [c.logprob for c in whole.choices[0].logprobs.content]
    assert finish == whole.choices[0].finish_reason


def test_dropped_middle_turn_branches_and_keeps_both_contexts(served):
    session, client = served.session("dropped")
    u1, u2, u3 = ({"role": "user", "content": t} for t in ("first", "second", "third"))
    r0 = _chat(client, [SYS, u1]).choices[0].message.model_dump()
    r1 = _chat(client, [SYS, u1, r0, u2]).choices[0].message.model_dump()
    _chat(client, [SYS, u1, r0, u3])           # the scaffold dropped u2 and its reply
    journal = load_journal(session.journal.path)
    inc = journal.calls.increments
    assert (inc[1].base, inc[2].base) == (0, 0)
    assert inc[2].shared == journal.calls.seq_len(0)        # branches at the end of call 0, exactly
    assert (session.stats.extends, session.stats.branches, session.stats.drift) == (1, 1, 0)
    tree = build_tree(list(journal.calls))
    assert int(tree.trained.sum()) == sum(c.output.size for c in journal.calls)   # both contexts kept
    assert r1["content"] is not None


def test_token_id_completions_and_models(served):
    session, client = served.session("tokens")
    assert [m.id for m in client.models.list().data] == [MODEL]
    prompt = embedded_tokenizer().encode("def f(x):")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=1)
    call = load_journal(session.journal.path).calls[0]
    assert call.prompt.tolist() == prompt
    assert r.choices[0].model_extra["token_ids"] == call.output.tolist()
    assert np.array_equal(np.asarray(r.choices[0].logprobs.token_logprobs, np.float32), call.logprobs)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_malformed_requests_get_openai_errors_and_break_no_other_session(served):
    good, good_client = served.session("good")
    bad, bad_client = served.session("bad")
    _chat(good_client, [SYS, {"role": "user", "content": "before"}])
    url = served.url + "/chat/completions"
    auth = {"Authorization": f"Bearer {bad.key}"}
    r = httpx.post(url, content=b"{not json", headers=auth)
    assert r.status_code == 400 and _error(r)["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(bad_client, [SYS], extra_body={"frobnicate": 1})
    assert exc.value.body["param"] == "frobnicate" and "frobnicate" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(bad_client, [SYS, {"role": "user", "content": "x " * WINDOW}])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(bad_client, [])
    assert exc.value.body["param"] == "messages"
    with pytest.raises(openai.AuthenticationError) as exc:
        _chat(openai.OpenAI(base_url=served.url, api_key="gyre-nobody", max_retries=0), [SYS])
    assert exc.value.code == "invalid_api_key"
    r = httpx.post(url, json={"model": MODEL, "messages": [SYS]}, headers={"X-Gyre-Session": "nobody"})
    assert r.status_code == 404 and _error(r)["param"] == "x-gyre-session"
    r = httpx.post(url, json={"model": MODEL, "messages": [SYS]})
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    # the header names a session as well as its key does
    r = httpx.post(url, json={"model": MODEL, "messages": [SYS], "max_tokens": 4}, headers={"X-Gyre-Session": bad.key})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    first = _chat(good_client, [SYS, {"role": "user", "content": "before"}])   # a retry, after all that
    assert load_journal(good.journal.path).calls.increments[1].base == 0
    assert first.choices[0].message.content is not None
    assert (len(load_journal(good.journal.path).calls), len(load_journal(bad.journal.path).calls)) == (2, 1)


def test_endpoint_overhead_per_call(served, capsys):
    """The endpoint's own time per call inside its handler (body parsing, planning, the journal's
    write + fsync, the reply), the engine's excluded; printed as JSON. Target <= 5 ms. The
    fsync is the harness's own runs' cost too (a record is durable before the call is acted on)."""
    session, client = served.session("bench")
    messages = [SYS, {"role": "user", "content": "go"}]
    for i in range(20):
        r = _chat(client, messages)
        messages = messages + [r.choices[0].message.model_dump(), {"role": "user", "content": f"step {i}"}]
    over = np.asarray(session.stats.overhead_s) * 1e3
    engine = np.asarray(session.stats.engine_s) * 1e3
    journal = np.asarray(session.stats.journal_s) * 1e3
    assert journal.size == over.size and (journal <= over).all()
    figures = {"calls": int(over.size), "overhead_ms_mean": round(float(over.mean()), 3),
               "overhead_ms_p50": round(float(np.median(over)), 3), "overhead_ms_max": round(float(over.max()), 3),
               "overhead_ms_p50_without_journal_fsync": round(float(np.median(over - journal)), 3),
               "journal_ms_p50": round(float(np.median(journal)), 3),
               "engine_ms_mean": round(float(engine.mean()), 3),
               "overhead_share": round(float(over.sum() / (over.sum() + engine.sum())), 4),
               "final_prompt_tokens": int(load_journal(session.journal.path).calls[-1].prompt.size),
               "target_ms": 5.0}
    with capsys.disabled():
        print("\nendpoint overhead:", json.dumps(figures))
    assert session.stats.extends == 19 and session.stats.drift == 0
    assert figures["overhead_ms_p50"] < 25.0    # loose: the 2-core machine is shared; the figure is the report


def test_parse_body_names_the_bad_field():
    from gyre_hpc.harness.openai_schema import APIError, ChatRequest, CompletionRequest, parse_body

    ok = parse_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 3}',
                    ChatRequest)
    assert ok.budget == 3 and ok.stream is False
    for raw, schema, param, code in [
            (b'{"model": "m", "messages": []}', ChatRequest, "messages", "invalid_value"),
            (b'{"model": "m", "messages": [{"role": "user"}], "max_tokens": 0}', ChatRequest, "max_tokens",
             "invalid_value"),
            (b'{"model": "m", "messages": [{"role": "user"}], "n": 2}', ChatRequest, "n", "invalid_value"),
            (b'{"model": "m", "prompt": [1, 2], "best_of": 2}', CompletionRequest, "best_of", "unknown_parameter"),
            (b'{"model": "m", "prompt": "text"}', CompletionRequest, "prompt", "invalid_value"),
            (b'[1]', ChatRequest, None, "invalid_json")]:
        with pytest.raises(APIError) as exc:
            parse_body(raw, schema)
        assert (exc.value.status, exc.value.param, exc.value.code) == (400, param, code), raw
        assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_registry_refuses_a_second_open_of_a_key_and_forgets_a_closed_one(tmp_path):
    from gyre_hpc.harness.client import Completion

    class Echo:      # a ModelClient that is not an engine: the registry needs none to run
        async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
            return Completion((), ())

    reg = SessionRegistry()
    s = reg.open("run-a", Echo(), tmp_path / "a.journal", key="k1")
    with pytest.raises(ValueError, match="'k1' is already open"):
        reg.open("run-b", Echo(), tmp_path / "b.journal", key="k1")
    assert reg.get("k1") is s and reg.close("k1") is s and reg.get("k1") is None
    assert reg.open("run-c", Echo(), tmp_path / "c.journal").key.startswith("gyre-")
    with pytest.raises(ValueError, match="context_window=1"):
        create_app(reg, ChatRenderer(embedded_tokenizer()), model_name=MODEL, context_window=1)


def test_a_failing_model_call_is_a_500_for_its_session_alone(served):
    class Broken:
        async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
            raise RuntimeError("engine lost")

    broken = served.registry.open("broken", Broken(), served.tmp / "broken.journal")
    _, fine = served.session("fine")
    r = httpx.post(served.url + "/chat/completions", json={"model": MODEL, "messages": [SYS]},
                   headers={"Authorization": f"Bearer {broken.key}"})
    assert r.status_code == 500
    err = _error(r)
    assert err["type"] == "server_error" and "engine lost" in err["message"]
    assert len(load_journal(broken.journal.path).calls) == 0 and not broken.lock.locked()
    assert _chat(fine, [SYS]).choices[0].finish_reason in ("stop", "length")


def test_split_tool_calls_keeps_malformed_blocks_as_text():
    from gyre_hpc.harness.actions import split_tool_calls

    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    assert split_tool_calls(f"let me look {call}") == ("let me look", [("bash", '{"command": "ls"}')])
    assert split_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>') == ("", [("a", '{"k": 1}')])
    assert split_tool_calls("x <tool_call>{bad}</tool_call> y") == ("x <tool_call>{bad}</tool_call> y", [])
    assert split_tool_calls('<tool_call>{"name": "cut"') == ('<tool_call>{"name": "cut"', [])


class ToolCaller:
    """A model client that always answers with one tool call (the tiny model rarely writes a
    well-formed one): what the endpoint does with calls is under test, not the model."""

    def __init__(self):
        from gyre_hpc.harness.actions import marker_ids

        tok = embedded_tokenizer()
        self.output = tuple(marker_ids(tok, "<tool_call>") + tok.encode('{"name": "bash", "arguments": {"command": "ls"}}')
                            + marker_ids(tok, "</tool_call>"))

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        from gyre_hpc.harness.client import Completion

        return Completion(self.output, tuple(-0.5 for _ in self.output))


TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]


def test_tool_calls_are_replied_as_openai_tool_calls_and_the_echo_extends(served):
    s = served.registry.open("tools", ToolCaller(), served.tmp / "tools.journal")
    client = openai.OpenAI(base_url=served.url, api_key=s.key, max_retries=0)
    messages = [SYS, {"role": "user", "content": "list the files"}]
    r = _chat(client, messages, tools=TOOLS, tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "ls"})
    streamed = [c for c in _chat(client, messages, tools=TOOLS, stream=True)]      # a retry, streamed
    deltas = [t for c in streamed if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [(call.function.name, call.function.arguments)]
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    echoed = choice.message.model_dump()
    echoed["tool_calls"][0]["id"] = call.id
    _chat(client, messages + [echoed, {"role": "tool", "tool_call_id": call.id, "content": "a.txt"}], tools=TOOLS)
    journal = load_journal(s.journal.path)
    inc = journal.calls.increments[2]
    assert (inc.base, inc.shared) == (0, journal.calls.seq_len(0))
    assert int(inc.new[0]) == embedded_tokenizer().eos_id       # the turn's end, after the sampled </tool_call>
    assert (s.stats.retries, s.stats.extends, s.stats.drift) == (1, 0, 0) and s.stats.branches == 1


def test_a_session_s_budgets_are_openai_errors_for_it_alone(served):
    good, good_client = served.session("budget-good")
    spent = served.registry.open("budget-spent", served.calls.client(0), served.tmp / "budget-spent.journal", max_calls=1)
    late = served.registry.open("budget-late", served.calls.client(0), served.tmp / "budget-late.journal",
                                deadline=time.monotonic() - 1.0)
    url = served.url + "/chat/completions"
    body = {"model": MODEL, "messages": [SYS, {"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {spent.key}"}).status_code == 200
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {spent.key}"})
    assert r.status_code == 429 and _error(r)["code"] == "turn_budget_spent" and spent.spent.is_set()
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {late.key}"})
    assert r.status_code == 408 and _error(r)["code"] == "run_timeout"
    spent.closed = True
    r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {spent.key}"})
    assert r.status_code == 404 and "has ended" in _error(r)["message"]
    assert _chat(good_client, [SYS, {"role": "user", "content": "still fine"}]).choices[0].message.role == "assistant"
    assert (len(load_journal(spent.journal.path).calls), len(load_journal(late.journal.path).calls)) == (1, 0)

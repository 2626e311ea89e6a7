"""The session token context planned against the embedded tokenizer's real ChatML template:
prompts extend the exact sampled ids, branch where the scaffold's history leaves them, and
count drift when a rebuilt reply no longer carries the sampled ids."""
from __future__ import annotations

import pytest

from gyre_hpc.harness.chat_render import ChatRenderer, ChatTemplateError
from gyre_hpc.harness.session_context import PromptPlan, SessionCall, normalize_message, plan_prompt
from gyre_hpc.models.tokenizer import embedded_tokenizer

TOK = embedded_tokenizer()
R = ChatRenderer(TOK)
SYS = {"role": "system", "content": "be brief"}
U1, U2, U3 = ({"role": "user", "content": t} for t in ("say hi", "again", "and once more"))


def non_canonical(text: str) -> tuple[int, ...]:
    """Ids of ``text`` one byte-token at a time: what a sampling model may emit, never what
    the tokenizer would produce from the text (so re-tokenizing it drifts)."""
    ids = tuple(i for ch in text for i in TOK.encode(ch))
    assert ids != tuple(TOK.encode(text))
    return ids + (TOK.eos_id,)


def reply_of(output: tuple[int, ...]) -> dict:
    return {"role": "assistant", "content": R.decode(output[:-1] if output[-1] == TOK.eos_id else output)}


def call(messages, output, calls=()) -> SessionCall:
    plan = plan_prompt(R, list(calls), messages)
    return SessionCall(tuple(normalize_message(m) for m in messages), reply_of(output), plan.prompt, output)


def test_first_call_is_the_rendered_template_with_generation_prompt():
    plan = plan_prompt(R, [], [SYS, U1])
    assert plan == PromptPlan(tuple(R.encode("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nsay hi"
                                             "<|im_end|>\n<|im_start|>assistant\n")), -1, 0, "render")
    assert plan.prompt[0] == TOK.special("<|im_start|>")


def test_extension_appends_only_new_turns_after_the_exact_sampled_ids():
    out = non_canonical("hello there")
    c0 = call([SYS, U1], out)
    plan = plan_prompt(R, [c0], [SYS, U1, c0.reply, U2])
    tail = R.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert plan == PromptPlan(c0.prompt + out + tuple(tail), 0, len(c0.seq), "extend", 0)
    # a fresh rendering would have re-tokenized the reply: the drift this avoids
    fresh = R.encode(R.render([SYS, U1, c0.reply, U2], add_generation_prompt=True))
    assert tuple(fresh) != plan.prompt and len(fresh) < len(plan.prompt)


def test_reply_cut_by_the_token_budget_gets_the_end_of_turn_appended():
    out = tuple(TOK.encode("hel"))          # no <|im_end|>: max_tokens ran out
    c0 = call([SYS, U1], out)
    plan = plan_prompt(R, [c0], [SYS, U1, c0.reply, U2])
    assert plan.prompt[:len(c0.seq)] == c0.seq
    assert plan.prompt[len(c0.seq)] == TOK.eos_id and plan.kind == "extend"


def test_echoed_reply_with_client_null_fields_still_extends():
    c0 = call([SYS, U1], non_canonical("hello there"))
    echoed = {**c0.reply, "refusal": None, "tool_calls": None, "annotations": None, "audio": None}
    assert plan_prompt(R, [c0], [SYS, U1, echoed, U2]).kind == "extend"


def test_three_turns_chain_each_prompt_on_the_previous_call():
    c0 = call([SYS, U1], non_canonical("hello one"))
    m1 = [SYS, U1, c0.reply, U2]
    c1 = call(m1, non_canonical("hello two"), [c0])
    plan = plan_prompt(R, [c0, c1], m1 + [c1.reply, U3])
    assert (plan.kind, plan.base, plan.shared) == ("extend", 1, len(c1.seq))
    assert plan.prompt[:len(c0.seq)] == c0.seq


def test_dropped_middle_turn_branches_from_the_earlier_call_with_exact_ids():
    c0 = call([SYS, U1], non_canonical("hello one"))
    m1 = [SYS, U1, c0.reply, U2]
    c1 = call(m1, non_canonical("hello two"), [c0])
    plan = plan_prompt(R, [c0, c1], [SYS, U1, c0.reply, U3])   # U2 and its reply dropped
    assert (plan.kind, plan.base, plan.shared, plan.drift) == ("extend", 0, len(c0.seq), 0)
    assert plan.prompt[:len(c0.seq)] == c0.seq
    assert plan.prompt[:len(c1.prompt)] != c1.prompt        # a branch: it leaves call 1's context


def test_retry_of_the_same_request_reuses_the_prompt():
    c0 = call([SYS, U1], non_canonical("hello one"))
    m1 = [SYS, U1, c0.reply, U2]
    c1 = call(m1, non_canonical("hello two"), [c0])
    assert plan_prompt(R, [c0, c1], m1) == PromptPlan(c1.prompt, 1, len(c1.prompt), "retry")
    assert plan_prompt(R, [c0, c1], [SYS, U1]) == PromptPlan(c0.prompt, 0, len(c0.prompt), "retry")


def test_edited_reply_is_rendered_fresh_branches_at_the_shared_prefix_and_counts_drift():
    c0 = call([SYS, U1], non_canonical("hello there"))
    edited = {"role": "assistant", "content": "hello there!"}
    plan = plan_prompt(R, [c0], [SYS, U1, edited, U2])
    assert plan.kind == "render" and plan.drift == 1
    assert (plan.base, plan.shared) == (0, len(c0.prompt))   # the rebuilt reply leaves the sampled ids at once
    assert plan.prompt == tuple(R.encode(R.render([SYS, U1, edited, U2], add_generation_prompt=True)))


def test_edited_reply_that_keeps_canonical_ids_is_no_drift():
    out = tuple(TOK.encode("hi")) + (TOK.eos_id,)     # the tokenizer's own ids for the text
    c0 = call([SYS, U1], out)
    # the scaffold drops the reply's text and writes the same text back (a compressed copy)
    plan = plan_prompt(R, [c0], [SYS, U1, {"role": "assistant", "content": "hi"}, U2, ])
    assert plan.kind == "extend"     # the same text is the same reply
    other = plan_prompt(R, [c0], [SYS, U1, {"role": "assistant", "content": "hi", "name": "x"}, U2])
    assert other.kind == "render" and other.drift == 0 and other.shared == len(c0.seq)


def test_unrelated_conversation_shares_only_the_common_prefix():
    c0 = call([SYS, U1], non_canonical("hello one"))
    plan = plan_prompt(R, [c0], [{"role": "system", "content": "other"}, U1])
    prefix = R.encode("<|im_start|>system\n")
    assert (plan.kind, plan.base, plan.drift) == ("render", 0, 0)
    assert plan.shared == len(prefix) and plan.prompt[:len(prefix)] == tuple(prefix)


def test_bad_messages_are_errors_that_say_why():
    with pytest.raises(ValueError, match="messages is empty"):
        plan_prompt(R, [], [])
    with pytest.raises(ValueError, match="'role'"):
        plan_prompt(R, [], [{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        plan_prompt(R, [], [{"role": "user"}, {"role": "user", "content": 3}])


def test_encode_splits_at_specials_and_decode_writes_them_back():
    text = "<|im_start|>user\nhi<|im_end|>\n"
    ids = R.encode(text)
    assert ids[0] == TOK.special("<|im_start|>") and TOK.eos_id in ids
    assert R.decode(ids) == text
    assert R.encode("a" + text) == R.encode("a") + ids


def test_render_passes_tools_and_tool_choice_to_the_template():
    from dataclasses import replace

    template = ("{% if tools %}{% for t in tools %}tool:{{ t['function']['name'] }}|{{ tool_choice }}\n{% endfor %}"
                "{% endif %}{% for m in messages %}{{ m['role'] }}:{{ m['content'] | tojson }}\n{% endfor %}")
    r = ChatRenderer(replace(TOK, chat_template=template))
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {}}}]
    assert r.render([U1], add_generation_prompt=True, tools=tools, tool_choice="auto") == 'tool:bash|auto\nuser:"say hi"\n'
    assert r.render([U1], add_generation_prompt=False) == 'user:"say hi"\n'


def test_template_raise_exception_is_a_chat_template_error():
    from dataclasses import replace

    r = ChatRenderer(replace(TOK, chat_template="{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        r.render([U1], add_generation_prompt=True)


def test_normalize_message_keeps_template_fields_and_joins_text_parts():
    m = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "refusal": None}
    assert normalize_message(m) == {"role": "user", "content": "ab"}
    assert normalize_message({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}) == \
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}


def test_rendering_and_ids_equal_transformers_apply_chat_template(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from dataclasses import replace

    # a template in the hub's style: whitespace control by trim_blocks/lstrip_blocks, tools as JSON
    template = ("{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
                "<|im_end|>\n{% endif %}\n{% for m in messages %}\n<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}\n"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = replace(TOK, chat_template=template)
    tok.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tools = [{"type": "function", "function": {"name": "bash", "description": "run é", "parameters": {}}}]
    messages = [SYS, U1, {"role": "assistant", "content": "hi there"}, U2]
    r = ChatRenderer(tok)
    for kw in ({}, {"tools": tools}):
        ours = r.render(messages, add_generation_prompt=True, **kw)
        assert ours == hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
        theirs = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
        theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
        assert r.encode(ours) == list(theirs)


def test_reply_with_tool_calls_extends_with_the_sampled_call_then_the_end_of_turn():
    from gyre_hpc.harness.actions import format_action

    out = tuple(format_action("exec", "ls"))        # stops at </tool_call>: no <|im_end|> sampled
    c0 = SessionCall(tuple(normalize_message(m) for m in (SYS, U1)),
                     normalize_message({"role": "assistant", "content": None,
                                        "tool_calls": [{"id": "c0", "type": "function",
                                                        "function": {"name": "exec", "arguments": '{"command": "ls"}'}}]}),
                     plan_prompt(R, [], [SYS, U1]).prompt, out)
    tool = {"role": "tool", "tool_call_id": "c0", "content": "a.txt"}
    plan = plan_prompt(R, [c0], [SYS, U1, {**c0.reply, "content": None}, tool])
    tail = R.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert plan == PromptPlan(c0.seq + tuple(tail), 0, len(c0.seq), "extend", 0)

from __future__ import annotations

import random

import pytest

from gyre_hpc.harness.actions import parse_action, format_action
from gyre_hpc.harness.tokenizer import (AGENT, BOS, CALL, END, ENV, EOS, PAD, SEP, VOCAB_SIZE, decode, encode,
                                        split_bytes)
from gyre_hpc.models.tiny_lm import BOS_ID, EOS_ID, FIRST_RESERVED_ID, PAD_ID
from gyre_hpc.models.tiny_lm import VOCAB_SIZE as MODEL_VOCAB


def test_specials_match_the_model_vocabulary():
    assert (PAD, BOS, EOS, VOCAB_SIZE) == (PAD_ID, BOS_ID, EOS_ID, MODEL_VOCAB)
    assert sorted({CALL, END, ENV, AGENT, SEP}) == list(range(FIRST_RESERVED_ID, VOCAB_SIZE))


@pytest.mark.parametrize("text", ["", "hello", "naïve café", "日本語のテキスト", "emoji 🚀🧪", "tab\tnl\n\x00nul"])
def test_encode_decode_round_trip(text):
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert decode(ids) == text


def test_round_trip_random_unicode():
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0xA0, 0xD7FF),
                                       rng.randrange(0x10000, 0x10FFFF)])) for _ in range(rng.randrange(30)))
        assert decode(encode(text)) == text


def test_decode_drops_or_shows_specials_and_rejects_unknown_ids():
    ids = [BOS] + encode("a") + [CALL] + encode("b") + [END]
    assert decode(ids) == "ab"
    assert decode(ids, show_specials=True) == "<bos>a<call>b<end>"
    assert decode([0xC3]) == "\ufffd"   # a torn UTF-8 sequence decodes, never raises
    with pytest.raises(ValueError, match="264"):
        decode([264])


def test_tool_calls_parse_and_format_round_trip():
    a = parse_action(format_action("write", "dir/f.py", "x = 1\n"))
    assert (a.tool, a.args) == ("write", (b"dir/f.py", b"x = 1\n"))
    assert parse_action(format_action("finish")).tool == "finish"
    assert parse_action(format_action("list")).args == ()
    assert parse_action(format_action("exec", "ls -la")).text() == "ls -la"
    assert parse_action(format_action("delegate", "write tests")).tool == "delegate"


@pytest.mark.parametrize("ids", [
    encode("ok 42"),                                   # plain text
    [CALL] + encode("zpath") + [END],                  # unknown letter
    [CALL] + encode("rpath"),                          # budget ran out before END
    [CALL] + encode("wonly-one-arg") + [END],          # wrong argument count
    [CALL, ord("r")] + encode("a") + [ENV] + [END],    # a stray special inside an argument
    encode("x") + [CALL] + encode("f") + [END],        # a call not at the start
    [],
])
def test_unparseable_output_is_the_default_answer_action(ids):
    a = parse_action(ids)
    assert a.tool == "answer"
    assert a.args == (split_bytes(ids),)

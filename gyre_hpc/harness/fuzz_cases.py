"""Hostile model output as data: a pure, seeded generator of model turns for the fuzzer.

Why a generator of its own: what a policy writes early in RL is anything at all (JSON cut by
the token budget, a path that climbs out, a command of a megabyte, a name that is a list, ten
calls in one turn, random token ids), and the harness must turn each into a status and a
score. ``fuzz.run_cases`` feeds these turns through the harness's own parser and loop; this
module only says what the turns are, so a test can read a case without running it.

Case ``i`` of seed ``s`` is a function of ``(s, i)`` alone (its own ``random.Random``), so the
first ``n`` cases are the same whatever the total, and a case that fails is rebuilt alone with
``generate_case(s, i)``. Kinds go round-robin, so any ``n >= len(KINDS)`` covers every kind;
the first case of each kind is its canonical variant (the million-line command for
``flood_output``) and is always executed; later cases are executed with probability
``exec_share`` and otherwise run through the parser only (a confined command costs ~0.1 s,
the parser ~1 ms).

A turn is a tuple of segments, encoded by the runner with the run's tokenizer: ``Text``
(ordinary text, repeated ``times`` over: a megabyte is one short piece encoded once, since
encoding it whole costs seconds), ``Ids`` (raw token ids, e.g. random ones) and ``Marker`` (a
tool-call marker, one special token where the vocabulary has it). ``BAIT`` in a text stands
for the absolute path of a directory beside the workspaces that no case may change.

Each case states what the harness should make of its last turn: ``expect_tool`` (what
``parse_action`` returns: a tool name, or ``"answer"`` for the default action) and, when it is
executed, ``expect_status`` (see ``fuzz.call_status``); ``None`` where it depends on context
(a ``delegate`` inside a sub-agent is refused, outside it runs).
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from gyre_hpc.models.tokenizer import EMBEDDED_VOCAB_SIZE, TOOL_CALL_END, TOOL_CALL_START

BAIT = "@BAIT@"


@dataclass(frozen=True)
class Text:
    text: str
    times: int = 1


@dataclass(frozen=True)
class Ids:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Marker:
    marker: str     # TOOL_CALL_START or TOOL_CALL_END


Segment = Text | Ids | Marker
Turn = tuple[Segment, ...]


@dataclass(frozen=True)
class FuzzCase:
    index: int
    kind: str
    variant: str
    turns: tuple[Turn, ...]
    execute: bool
    expect_tool: str | None
    expect_status: str | None


def _call(body: str | Turn) -> Turn:
    inner = (Text(body),) if isinstance(body, str) else body
    return (Marker(TOOL_CALL_START), *inner, Marker(TOOL_CALL_END))


def _good(tool: str, **arguments) -> Turn:
    return _call(json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False))


def _with_value(tool: str, name: str, value: Turn, **before) -> Turn:
    """A call whose argument ``name`` is ``value`` written as raw JSON (any type, any size)."""
    head = json.dumps({"name": tool, "arguments": dict(before, **{name: 0})})[:-3]   # cut `0}}`
    return _call((Text(head), *value, Text("}}")))


# A kind: rng -> its variants, each (name, turns or a function making them, expect_tool, expect_status);
# the first is canonical.


def _well_formed(rng: random.Random):
    k = rng.randrange(1000)
    return [
        ("write", (_good("write", path=f"notes/{k}.txt", content=f"note {k}\n"),), "write", "ok"),
        ("read", (_good("read", path="README.md"),), "read", "ok"),
        ("list", (_good("list"),), "list", "ok"),
        ("exec", (_good("exec", command=f"echo ok {k}"),), "exec", "ok"),
        ("test", (_good("test"),), "test", "ok"),
        ("delegate", (_good("delegate", task=f"write notes/sub{k}.txt"),), "delegate", None),
        ("finish", (_good("finish", message="done"),), "finish", "finished"),
    ]


def _malformed_json(rng: random.Random):
    whole = json.dumps({"name": "write", "arguments": {"path": "m.txt", "content": "x"}})
    cut = rng.randrange(1, len(whole))
    return [
        ("cut_by_budget", ((Marker(TOOL_CALL_START), Text(whole[:cut])),), "answer", "default_action"),
        ("truncated_body", (_call(whole[:cut]),), "answer", "default_action"),
        ("trailing_garbage", (_call(whole + "}}]"),), "answer", "default_action"),
        ("single_quotes", (_call(whole.replace('"', "'")),), "answer", "default_action"),
        ("comment", (_call("// call\n" + whole),), "answer", "default_action"),
        ("no_start_marker", ((Text(whole), Marker(TOOL_CALL_END)),), "answer", "default_action"),
        ("text_before_call", ((Text("Sure! "), *_call(whole)),), "answer", "default_action"),
        ("arguments_bad_json_string", (_call('{"name": "read", "arguments": "{path: README.md"}'),),
         "answer", "default_action"),
        ("whitespace_before_call", ((Text("\n  "), *_call(whole)),), "write", "ok"),
    ]


def _unknown_tool(rng: random.Random):
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz_") for _ in range(rng.randrange(1, 12)))
    return [
        ("name_is_list", (_call('{"name": ["read"], "arguments": {"path": "README.md"}}'),), "answer", "default_action"),
        ("random_name", (_good("x_" + word, path="README.md"),), "answer", "default_action"),
        ("wrong_case", (_good("Read", path="README.md"),), "answer", "default_action"),
        ("shell_name", (_good("rm", path="-rf /"),), "answer", "default_action"),
        ("empty_name", (_good("", path="README.md"),), "answer", "default_action"),
        ("name_is_null", (_call('{"name": null, "arguments": {}}'),), "answer", "default_action"),
        ("name_is_object", (_call('{"name": {"tool": "read"}, "arguments": {}}'),), "answer", "default_action"),
        ("name_is_number", (_call('{"name": 7, "arguments": {}}'),), "answer", "default_action"),
        ("unknown_argument", (_good("read", path="README.md", mode="rb"),), "answer", "default_action"),
        ("argument_for_no_argument_tool", (_good("test", path="."),), "answer", "default_action"),
        ("missing_required_argument", (_good("write", path="x.txt"),), "answer", "default_action"),
    ]


# Sizes of a huge argument: mostly tens of kilobytes, now and then a megabyte.
_HUGE_BYTES = (8 << 10, 64 << 10, 256 << 10, 1 << 20)
_HUGE_WEIGHTS = (8, 5, 2, 1)


def _huge_argument(rng: random.Random):
    n = rng.choices(_HUGE_BYTES, _HUGE_WEIGHTS)[0]
    # A phrase the embedded BPE merges well (~0.2 tokens a byte): a 1 MiB argument is ~200K tokens.
    blob = Text("the test passed ", times=n // 16)
    return [
        # ~30K non-ASCII characters: small as UTF-8, but each is six bytes as the jail's JSON
        # argument (``\\uXXXX``), past the kernel's 128 KiB limit on one argv string.
        ("exec_non_ascii_command", (_with_value("exec", "command", (Text('"echo '), Text("é", times=30_000), Text('"'))),),
         "exec", "refused"),
        ("write_content", (_with_value("write", "content", (Text('"'), blob, Text('"')), path="huge.txt"),), "write", "ok"),
        ("exec_ascii_command", (_with_value("exec", "command", (Text('"echo '), Text("a", times=200_000), Text('"'))),),
         "exec", "refused"),
        ("path", (_with_value("read", "path", (Text('"'), Text("d/", times=n // 2), Text('f"'))),), "read", "refused"),
        ("path_component", (_good("write", path="n" * 300, content="x"),), "write", "refused"),
        ("delegate_task", (_with_value("delegate", "task", (Text('"'), blob, Text('"'))),), "delegate", None),
        ("finish_message", (_with_value("finish", "message", (Text('"'), blob, Text('"'))),), "finish", "finished"),
        # appended to answer.txt: at most 256 KiB, so a run's 16 turns stay under the 8 MB file limit
        ("plain_text", ((Text("the test passed ", times=min(n, 256 << 10) // 16),),), "answer", "default_action"),
    ]


def _binary(rng: random.Random, vocab_size: int):
    random_ids = lambda: Ids(tuple(rng.choices(range(vocab_size), k=rng.randrange(1, 2000))))  # noqa: E731
    return [
        ("random_ids", lambda: ((random_ids(),),), "answer", "default_action"),
        ("lone_surrogate", (_call('{"name": "write", "arguments": {"path": "s.txt", "content": "\\ud800x"}}'),),
         "answer", "default_action"),
        ("control_characters", (_call('{"name": "write", "arguments": {"path": "c.txt", "content": "\\u0000\\u0001\\u001b[2J"}}'),),
         "write", "ok"),
        ("random_ids_in_string", lambda: (_with_value("write", "content", (Text('"'), random_ids(), Text('"')), path="r.txt"),),
         None, None),
        ("undecodable_file_name", (_good("exec", command="touch \"$(printf 'bad\\377\\376name')\""), _good("list")),
         "list", "ok"),
        ("read_binary_file", (_good("exec", command="head -c 3000 /dev/urandom > rnd.bin"), _good("read", path="rnd.bin")),
         "read", "ok"),
    ]


# Paths every file tool must refuse (the workspace is <root>/workspaces/<run>, the bait <root>/bait).
_ESCAPES = ("../../bait/secret.txt", "..", "../x.txt", "a/../../x.txt", "../../escaped.txt", f"{BAIT}/secret.txt",
            "/etc/passwd", "/proc/self/environ", "/proc/self/root/etc/passwd", "../../../../../../proc/self/mem",
            "/dev/zero", "\u0000", "a\u0000b", "/", "//", "nothere/../../x")


def _path_trick(rng: random.Random):
    refused = [(f"{tool}:{path!r}", (_good("write", path=path, content="pwned") if tool == "write" else _good(tool, path=path),),
                tool, "refused") for path in _ESCAPES for tool in ("write", "read", "list")]
    # "" and " " are the workspace itself to list (list's default), so only read and write refuse them.
    blank = [(f"{tool}:{path!r}", (_good(tool, path=path, content="x") if tool == "write" else _good(tool, path=path),),
              tool, "refused") for path in ("", " ") for tool in ("write", "read")]
    inside = [("inside_via_dotdot", (_good("write", path="a/../inside.txt", content="ok"),), "write", "ok"),
              ("backslashes_are_a_name", (_good("write", path="\\..\\..\\x", content="ok"),), "write", "ok")]
    return refused + blank + inside


def _symlink_escape(rng: random.Random):
    ln = lambda cmd: _good("exec", command=cmd)  # noqa: E731
    return [
        ("read_link_to_bait", (ln(f"ln -s {BAIT}/secret.txt l"), _good("read", path="l")), "read", "refused"),
        ("write_link_to_bait", (ln(f"ln -s {BAIT}/secret.txt l"), _good("write", path="l", content="pwned")), "write", "refused"),
        ("relative_link_out", (ln("ln -s ../../bait/secret.txt r"), _good("write", path="r", content="pwned")), "write", "refused"),
        ("link_to_bait_dir", (ln(f"ln -s {BAIT} d"), _good("write", path="d/new.txt", content="pwned")), "write", "refused"),
        ("list_link_to_bait_dir", (ln(f"ln -s {BAIT} d"), _good("list", path="d")), "list", "refused"),
        ("dangling_link_out", (ln(f"ln -s {BAIT}/new.txt n"), _good("write", path="n", content="pwned")), "write", "refused"),
        ("proc_root_link", (ln("ln -s /proc/self/root p"), _good("read", path="p/etc/passwd")), "read", "refused"),
        ("proc_cwd_link", (ln("ln -s /proc/self/cwd c"), _good("write", path="c/x.txt", content="pwned")), "write", "refused"),
        ("link_loop", (ln("ln -s a b; ln -s b a"), _good("read", path="a")), "read", "refused"),
        ("fifo_read", (ln("mkfifo f"), _good("read", path="f")), "read", "refused"),
        ("fifo_write", (ln("mkfifo f"), _good("write", path="f", content="x")), "write", "refused"),
        # a file of its own: a second link to README.md would make later cases' reads of it refused
        ("hard_link", (ln("echo x > own.txt && ln own.txt h"), _good("read", path="h")), "read", "refused"),
        ("link_inside", (ln("ln -s README.md i"), _good("read", path="i")), "read", "ok"),
    ]


# Python's json raises RecursionError past ~1000 levels; the deepest costs ~0.3 s to decode.
_DEPTHS = (50, 500, 5000, 100_000)
_DEPTH_WEIGHTS = (8, 4, 2, 1)


def _deep_nesting(rng: random.Random):
    d = rng.choices(_DEPTHS, _DEPTH_WEIGHTS)[0]
    arrays = (Text("[", times=d), Text("]", times=d))
    objects = (Text('{"a": ', times=d), Text("1"), Text("}", times=d))
    return [
        ("arguments_deep_arrays", (_with_value("write", "content", arrays, path="d.txt"),), "answer", "default_action"),
        ("arguments_deep_objects", (_with_value("read", "path", objects),), "answer", "default_action"),
        ("arguments_deep_json_string", (_call((Text('{"name": "read", "arguments": "'), Text("[", times=d), Text('"}'))),),
         "answer", "default_action"),
        ("call_inside_arrays", (_call((arrays[0], Text('{"name": "list"}'), arrays[1])),), "answer", "default_action"),
    ]


def _wrong_types(rng: random.Random):
    value = rng.choice(['1', 'null', 'true', '["README.md"]', '{"p": "README.md"}', '3.5', 'NaN', '-Infinity',
                        '1e999', '1' * 5000])
    return [
        ("path_not_a_string", (_with_value("read", "path", (Text(value),)),), "answer", "default_action"),
        ("content_not_a_string", (_with_value("write", "content", (Text(value),), path="t.txt"),), "answer", "default_action"),
        ("arguments_not_an_object", (_call(f'{{"name": "list", "arguments": {value}}}'),), "answer", "default_action"),
        ("call_not_an_object", (_call(value),), "answer", "default_action"),
        ("arguments_as_json_string", (_call(json.dumps({"name": "read", "arguments": json.dumps({"path": "README.md"})})),),
         "read", "ok"),
        ("name_missing", (_call('{"arguments": {"path": "README.md"}}'),), "answer", "default_action"),
    ]


MILLION_LINES = ("exec_seq_million", "exec_yes_million", "exec_python_million")


def _flood_output(rng: random.Random):
    ex = lambda cmd: _good("exec", command=cmd)  # noqa: E731
    return [
        ("exec_seq_million", (ex("seq 1000000"),), "exec", "truncated"),
        ("exec_yes_million", (ex("yes | head -n 1000000"),), "exec", "truncated"),
        ("exec_python_million", (ex("python3 -c \"print('x\\n' * 1000000)\""),), "exec", "truncated"),
        ("exec_zeros", (ex("cat /dev/zero"),), "exec", "truncated"),
        ("read_million_line_file", (ex("seq 1000000 > big.txt"), _good("read", path="big.txt")), "read", "ok"),
        ("list_many_files", (ex("mkdir many && cd many && seq 3000 | xargs touch"), _good("list", path="many")), "list", "ok"),
        ("file_past_size_limit", (ex("head -c 9000000 /dev/zero > huge.bin"),), "exec", "exit_nonzero"),
    ]


def _empty(rng: random.Random):
    return [
        ("no_tokens", ((),), "answer", "default_action"),
        ("start_marker_only", ((Marker(TOOL_CALL_START),),), "answer", "default_action"),
        ("markers_only", (_call(""),), "answer", "default_action"),
        ("whitespace", ((Text(" \n\t "),),), "answer", "default_action"),
        ("empty_object", (_call("{}"),), "answer", "default_action"),
        ("name_only_test", (_call('{"name": "test"}'),), "test", "ok"),
        ("name_only_finish", (_call('{"name": "finish"}'),), "finish", "finished"),
    ]


def _many_calls(rng: random.Random):
    n = rng.randrange(2, 200)
    listing = _good("list") * n
    return [
        ("writes", lambda: (tuple(s for i in range(n) for s in _good("write", path=f"many/{i}.txt", content=str(i))),),
         "write", "ok"),
        ("malformed_first", ((*_call("{"), *listing),), "answer", "default_action"),
        ("text_between", lambda: (tuple(s for i in range(n) for s in (*_good("list"), Text(f" then {i} "))),), "list", "ok"),
        ("garbage_after", ((*_good("read", path="README.md"), Ids((0, 1, 2, 3) * n)),), "read", "ok"),
        ("nested_markers", ((Marker(TOOL_CALL_START), *_good("list"), Marker(TOOL_CALL_END)),), "answer", "default_action"),
        ("finishes", (_good("finish", message="done") * n,), "finish", "finished"),
    ]


KINDS: dict[str, Callable[..., list[tuple[str, tuple[Turn, ...], str | None, str | None]]]] = {
    "well_formed": _well_formed,          # the control: calls a trained model writes
    "malformed_json": _malformed_json,
    "unknown_tool": _unknown_tool,
    "huge_argument": _huge_argument,
    "binary": _binary,
    "path_trick": _path_trick,
    "symlink_escape": _symlink_escape,
    "deep_nesting": _deep_nesting,
    "wrong_types": _wrong_types,
    "flood_output": _flood_output,
    "empty": _empty,
    "many_calls": _many_calls,
}


def _variants(kind: str, rng: random.Random, vocab_size: int) -> list:
    return KINDS[kind](rng, vocab_size) if kind == "binary" else KINDS[kind](rng)


def _case(index: int, kind: str, entry: tuple, execute: bool) -> FuzzCase:
    variant, turns, expect_tool, expect_status = entry
    if callable(turns):     # built only when chosen: a few variants are costly to build
        turns = turns()
    return FuzzCase(index, kind, variant, turns, execute, expect_tool, expect_status)


def generate_case(seed: int, index: int, exec_share: float = 0.05, vocab_size: int = EMBEDDED_VOCAB_SIZE) -> FuzzCase:
    """Case ``index`` of ``seed``: the same whatever else is generated."""
    names = list(KINDS)
    kind = names[index % len(names)]
    canonical = index < len(names)
    key = f"gyre-fuzz:{seed}:{index}"     # a str seed is hashed with SHA-512: stable across processes
    rng = random.Random(key)
    variants = _variants(kind, rng, vocab_size)
    execute = canonical or random.Random(key + ":execute").random() < exec_share
    return _case(index, kind, variants[0] if canonical else rng.choice(variants), execute)


def named_case(kind: str, variant: str, index: int = 0, seed: int = 0, vocab_size: int = EMBEDDED_VOCAB_SIZE) -> FuzzCase:
    """Variant ``variant`` of ``kind``, to be executed: a planted case for a test, or one that a
    report names, rerun alone. Raises ValueError listing the kind's variants for a wrong name."""
    if kind not in KINDS:
        raise ValueError(f"fuzz kind {kind!r} is unknown: valid kinds are {', '.join(KINDS)}")
    variants = _variants(kind, random.Random(f"gyre-fuzz:{seed}:{index}"), vocab_size)
    for entry in variants:
        if entry[0] == variant:
            return _case(index, kind, entry, True)
    raise ValueError(f"fuzz kind {kind!r} has no variant {variant!r}: its variants are {', '.join(e[0] for e in variants)}")


def generate_cases(n: int, seed: int, exec_share: float = 0.05, vocab_size: int = EMBEDDED_VOCAB_SIZE) -> list[FuzzCase]:
    """Cases ``0..n-1``; every kind from ``n >= len(KINDS)``, each kind's first one executed."""
    if n < 0 or not 0.0 <= exec_share <= 1.0:
        raise ValueError(f"generate_cases(n={n}, exec_share={exec_share}): n must be >= 0, exec_share in [0, 1]")
    return [generate_case(seed, i, exec_share, vocab_size) for i in range(n)]

"""The fuzzer of model-written tool calls (``harness/fuzz_cases.py``, ``harness/fuzz.py``) and
the harness bugs it found, each pinned by a test that fails without its fix.

Everything runs the real parser, loop, tools, jail and checker; the bait directory beside the
workspaces is the target of every path trick and must come out unchanged.
"""
from __future__ import annotations

import pytest

from gyre_hpc.harness.actions import parse_action
from gyre_hpc.harness.confine import MAX_SPEC_BYTES, Limits
from gyre_hpc.harness.fuzz import CaseOutcome, FuzzResult, call_status, run_cases, summarize
from gyre_hpc.harness.fuzz_cases import KINDS, MILLION_LINES, generate_case, generate_cases, named_case
from gyre_hpc.harness.tokenizer import encode
from gyre_hpc.harness.tools import ToolError, Workspace
from gyre_hpc.models.tokenizer import embedded_tokenizer

_TOK = embedded_tokenizer()
START, END = _TOK.token_id("<tool_call>"), _TOK.token_id("</tool_call>")


def _call(body: str) -> list[int]:
    return [START] + encode(body) + [END]


def test_cases_are_a_function_of_seed_and_index():
    cases = generate_cases(120, seed=3)
    assert cases == generate_cases(120, seed=3)
    assert generate_cases(40, seed=3) == cases[:40]           # the same whatever the total
    assert generate_case(3, 77) == cases[77]                  # one case rebuilt alone
    other = generate_cases(120, seed=4)
    assert [c.variant for c in other] != [c.variant for c in cases]
    assert [c.execute for c in other] != [c.execute for c in cases]


def test_every_kind_is_covered_and_each_kinds_first_case_is_executed():
    cases = generate_cases(len(KINDS) * 3, seed=0, exec_share=0.0)
    assert [c.kind for c in cases[:len(KINDS)]] == list(KINDS)
    assert {c.kind for c in cases} == set(KINDS)
    assert all(c.execute for c in cases[:len(KINDS)]) and not any(c.execute for c in cases[len(KINDS):])
    flood = next(c for c in cases if c.kind == "flood_output")
    assert flood.execute and flood.variant in MILLION_LINES      # a million-line output in every run of the bench
    with pytest.raises(ValueError, match="its variants are read_link_to_bait"):
        named_case("symlink_escape", "no-such-variant")


def test_500_cases_escape_nothing_write_nothing_outside_and_all_have_an_outcome(tmp_path):
    cases = generate_cases(500, seed=1, exec_share=0.03)
    result = run_cases(cases, tmp_path / "fuzz")
    report = summarize(result)
    assert report["escaped"] == 0, report["escaped_cases"]
    assert report["written_outside"] == []
    assert report["unexpected"] == 0, report["unexpected_cases"]
    for case, out in zip(cases, result.outcomes):
        assert len(out.tools) == len(case.turns) and "escaped" not in out.tools
        if case.execute:
            assert "not_run" not in out.statuses and out.run_status in ("finished", "timeout")
            assert out.reward is not None and 0.0 <= out.reward <= 1.0
    assert set(report["by_kind"]) == set(KINDS)
    assert report["executed"]["million_line_outputs"] >= 1
    assert report["executed"]["run_status"] == {"finished": len(result.runs)}


def test_planted_escapes_and_floods_get_their_statuses(tmp_path):
    planted = [
        named_case("symlink_escape", "write_link_to_bait", 0),
        named_case("symlink_escape", "read_link_to_bait", 1),
        named_case("symlink_escape", "relative_link_out", 2),
        named_case("symlink_escape", "link_to_bait_dir", 3),
        named_case("symlink_escape", "proc_root_link", 4),
        named_case("path_trick", "write:'../../bait/secret.txt'", 5),
        named_case("path_trick", "write:'../../escaped.txt'", 6),
        named_case("flood_output", "exec_seq_million", 7),
        named_case("flood_output", "read_million_line_file", 8),
        named_case("symlink_escape", "link_inside", 9),
    ]
    result = run_cases(planted, tmp_path / "fuzz")
    by_variant = {o.variant: o for o in result.outcomes}
    for name in ("write_link_to_bait", "read_link_to_bait", "relative_link_out", "link_to_bait_dir", "proc_root_link",
                 "write:'../../bait/secret.txt'", "write:'../../escaped.txt'"):
        assert by_variant[name].statuses[-1] == "refused", by_variant[name]
    assert by_variant["exec_seq_million"].statuses == ["truncated"]
    assert by_variant["read_million_line_file"].statuses == ["ok", "ok"]
    assert by_variant["link_inside"].statuses[-1] == "ok"         # a symlink that stays inside still works
    assert result.written_outside == []
    assert (tmp_path / "fuzz/bait/secret.txt").read_text() == "secret\n"
    assert not (tmp_path / "fuzz/escaped.txt").exists()
    assert all(o.run_status == "finished" and o.escaped is None for o in result.outcomes)


@pytest.mark.parametrize("kind, variant", [
    ("unknown_tool", "name_is_list"), ("unknown_tool", "name_is_object"), ("deep_nesting", "arguments_deep_arrays"),
    ("binary", "lone_surrogate"), ("huge_argument", "exec_non_ascii_command"), ("binary", "undecodable_file_name"),
])
def test_a_case_that_once_escaped_now_ends_its_call_with_a_status(tmp_path, kind, variant):
    """Before the fixes each of these raised inside AgentRun: the run ended 'failed' (counted
    as escaped here) or, from the parser, raised out of it."""
    case = named_case(kind, variant, seed=0)
    if kind == "deep_nesting":   # the depth is drawn; plant one past json's ~1000 levels
        case = next(c for c in (named_case(kind, variant, seed=s) for s in range(50))
                    if sum(getattr(seg, "times", 1) for seg in c.turns[0]) > 2 * 5000)
    out = run_cases([case], tmp_path / "fuzz").outcomes[0]
    assert out.escaped is None, out.escaped
    assert out.run_status == "finished"
    assert out.statuses[-1] == case.expect_status and out.unexpected is None


@pytest.mark.parametrize("body", [
    '{"name": ["read"], "arguments": {"path": "a"}}',                  # TypeError: unhashable type
    '{"name": {"x": 1}, "arguments": {}}',
    '{"name": "read", "arguments": ' + "[" * 5000 + "]" * 5000 + "}",   # RecursionError
    '{"name": "read", "arguments": "' + "[" * 5000 + '"}',
    '{"name": "read", "arguments": {"path": ' + "1" * 5000 + "}}",     # ValueError: more than 4300 digits
    '{"name": "write", "arguments": {"path": "a", "content": "\\ud800"}}',   # UnicodeEncodeError
])
def test_parse_action_makes_unparseable_json_the_default_action(body):
    action = parse_action(_call(body))
    assert action.tool == "answer" and action.args[0].startswith(b'{"name"')


def test_a_command_too_long_for_the_jail_argument_is_a_tool_error(tmp_path):
    ws = Workspace(tmp_path, Limits(wall_s=20.0))
    with pytest.raises(ToolError, match="past the kernel's limit of 131072"):
        ws.run("echo " + "é" * 30_000)           # 60 KB of UTF-8, 180 KB as the jail's JSON (E2BIG before)
    near = ws.run("echo " + "a" * (MAX_SPEC_BYTES - 2000))   # just under the limit still runs
    assert near.returncode == 0 and near.truncated


def test_list_shows_undecodable_file_names_as_replacement_characters(tmp_path):
    (tmp_path / "ok.txt").write_text("x")
    (tmp_path.joinpath(b"bad\xffname".decode("utf-8", "surrogateescape"))).write_text("x")
    names = Workspace(tmp_path).list()
    assert names == ["bad\ufffdname", "ok.txt"]
    assert "\n".join(names).encode("utf-8")      # what the loop does with a tool result; raised before


def test_call_status_reads_the_result_text_the_loop_shows():
    assert call_status("exec", "x\n[output truncated]") == "truncated"
    assert call_status("exec", "x\n[output truncated]\n[exit 0]") == "truncated"
    assert call_status("exec", "\n[killed: wall-clock timeout]") == "timeout"
    assert call_status("exec", "hi\n\n[exit 0]") == "ok" and call_status("exec", "\n[exit 2]") == "exit_nonzero"
    assert call_status("read", "error: path '..' leads outside the workspace") == "refused"
    assert call_status("answer", "appended 3 bytes to answer.txt") == "default_action"


def test_summary_counts_an_escape_and_a_write_outside():
    """The bench's verdict is only as good as its counting: a synthetic result with one escape."""
    outs = [CaseOutcome(0, "well_formed", "read", False, tools=["read"]),
            CaseOutcome(1, "unknown_tool", "name_is_list", True, tools=["escaped"], statuses=["escaped"],
                        run_status="failed", reward=0.0, escaped="parse_action raised TypeError: unhashable")]
    report = summarize(FuzzResult(outs, [("failed", 0.0)], ["escaped.txt"], {"well_formed": 1e-4}, 0.5))
    assert report["escaped"] == 1 and report["escaped_cases"][0]["variant"] == "name_is_list"
    assert report["written_outside"] == ["escaped.txt"]
    assert report["by_kind"]["unknown_tool"]["call_status"] == {"escaped": 1}

"""The xlong suite and its reactive teacher, through the real harness loop (tools, checker, journal)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from gyre_hpc.config import load_config
from gyre_hpc.harness.actions import format_action, parse_action
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.repo_teacher import RepoTeacher, first_failure, last_user_turn
from gyre_hpc.harness.tasks import check_workspace, load_suite
from gyre_hpc.harness.tasks.xlong import (LARGE_SIZES, MODULES, SIZES, XLONG_PLAYBOOKS, fix_message, module_source,
                                         repo_variant)
from gyre_hpc.harness.tools import ToolError
from gyre_hpc.models.tokenizer import embedded_tokenizer
from gyre_hpc.trees.builder import build_tree

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "xlong.yaml"


def _tasks():
    return {t.task_id: t for t in load_suite("xlong")}


def _harness() -> HarnessConfig:
    """The shipped config's harness, without its wall clock (the machine may be loaded)."""
    return HarnessConfig.from_rollout(load_config(EXAMPLE).rollout, run_timeout_s=3600)


def test_checker_grades_module_by_module_and_names_the_next_fix(tmp_path):
    task = _tasks()["xl-p5"]
    pb = XLONG_PLAYBOOKS["xl-p5"]
    ws = task.materialize(tmp_path / "ws")
    report = check_workspace(task, ws)
    assert report.score == 0.0 and len(task.tests) == 5 * (MODULES + 1)
    first = pb.modules[0]
    assert first_failure(report.summary()) == (True, "p0/m00")
    # The report the model sees: the count and the first failure, its fix spelled as the call's
    # own arguments (a module of a delegated package also names the sub-agent's task).
    shown = report.summary(failures=task.report_failures)
    assert shown == (f"0/{len(task.tests)} tests passed\nFAIL p0/m00: AssertionError: fix "
                     f'{{"path": "p0/m00.py", "content": "def f(x):\\n    return {first.want}\\n"}}')
    assert fix_message(pb.modules[MODULES], "p0").endswith(', "task": "p1"}')
    for m in pb.modules[:3]:
        (ws / m.path).write_text(module_source(m.want))
    (ws / pb.modules[3].path).write_text("def f(x) return\n")          # does not parse: same message
    report = check_workspace(task, ws)
    assert report.score == pytest.approx(3 / len(task.tests))
    assert f"FAIL p0/m03: AssertionError: {fix_message(pb.modules[3], 'p0')}" in report.summary()
    for m in pb.modules[3:MODULES]:
        (ws / m.path).write_text(module_source(m.want.replace("*", " * ")))   # spacing does not matter
    report = check_workspace(task, ws)     # p0's modules and its package test (their behaviour) pass
    assert report.score == pytest.approx((MODULES + 1) / len(task.tests))
    assert first_failure(report.summary())[1] == "p1/m00"
    scoped = check_workspace(task.scoped("p0"), ws)
    assert scoped.score == 1.0 and scoped.summary() == f"{MODULES + 1}/{MODULES + 1} tests passed"
    with pytest.raises(ToolError, match="no test is named 'p9'"):
        task.scoped("p9")


def test_test_tool_takes_a_scope_through_the_loop(tmp_path):
    task = _tasks()["xl-p5"]

    class Script:
        def __init__(self):
            self.prompts = []

        async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
            self.prompts.append(embedded_tokenizer().decode(prompt, skip_special_tokens=False))
            ids = format_action(*[("test", "p2"), ("test", "nope"), ("finish",)][len(self.prompts) - 1])
            return Completion(tuple(ids), (0.0,) * len(ids), 0)

    client = Script()
    cfg = HarnessConfig(max_new_tokens=64, context_limit=4096, max_retries=0)
    r = asyncio.run(AgentRun(task, tmp_path / "ws", client, tmp_path / "j", cfg).run())
    assert r.status == "finished" and len(r.calls) == 3
    assert f"0/{MODULES + 1} tests passed\nFAIL p2/m00" in client.prompts[1] and "FAIL p2/m01" not in client.prompts[1]
    assert "error: no test is named 'nope'" in client.prompts[2]


def test_teacher_reads_the_last_turn_of_the_prompt():
    assert last_user_turn("<|im_start|>user\n<tool_response>\n3/4 tests passed\nFAIL a: x\n</tool_response>"
                          "<|im_end|>\n<|im_start|>assistant\n") == ("result", "3/4 tests passed\nFAIL a: x")
    assert last_user_turn("<|im_start|>user\nretry 1: 0/1 tests passed<|im_end|>\n") == ("retry", "0/1 tests passed")
    assert last_user_turn("<|im_start|>user\nsummary: Run the tests<|im_end|>\n")[0] == "summary"
    assert last_user_turn("<|im_start|>user\nMake the tests pass<|im_end|>\n")[0] == "start"
    assert first_failure("5/5 tests passed") == (True, None)
    assert first_failure("wrote 3 bytes") == (False, None)


@pytest.mark.slow   # four runs of 230-470 calls, ~1,000 checks: ~1.5 min on a busy 2-core box
def test_teacher_finishes_every_task_the_long_way(tmp_path):
    cfg = _harness()
    tasks = list(_tasks().values())

    async def all_runs():
        runs = [AgentRun(t, tmp_path / t.task_id, RepoTeacher(t, seed=s), tmp_path / f"{t.task_id}.journal", cfg,
                         run_id=t.task_id) for s, t in enumerate(tasks)]
        return await asyncio.gather(*(r.run() for r in runs))

    results = asyncio.run(all_runs())
    calls = [len(r.calls) for r in results]
    assert all(r.status == "finished" and r.reward == 1.0 for r in results), [(r.status, r.reward) for r in results]
    assert min(calls) >= 200 and max(calls) >= 400, calls
    assert all(r.compressions >= 2 for r in results)
    assert [r.delegations for r in results] == [n - 1 for n in SIZES.values()]
    assert any(r.retries for r in results)            # an early finish, answered by the harness's retry
    for r in results:
        assert {c.role for c in r.calls.increments} == {"main", "subagent", "summary"}
        assert all(parse_action(c.output).tool != "answer" for c in r.calls.increments if c.role != "summary")
        # A context of hundreds of calls per run: what the must-show of bench xlong counts.
        context = sum(c.prompt_len for c in r.calls.increments)
        assert context > 1000 * len(r.calls)
    # The tree of the longest run, from increments and from whole prompts: the same, bit for bit.
    longest = max(results, key=lambda r: len(r.calls))
    tree, whole = build_tree(longest.calls), build_tree(list(longest.calls))
    assert np.array_equal(tree.tokens, whole.tokens) and np.array_equal(tree.parent, whole.parent)
    for k in (0, len(longest.calls) // 2, len(longest.calls) - 1):
        np.testing.assert_array_equal(tree.path(k), longest.calls.seq(k))


def test_xlong_large_holds_larger_repositories_of_the_same_kind():
    large, small = {t.task_id: t for t in load_suite("xlong-large")}, _tasks()
    assert list(large) == list(LARGE_SIZES) and min(LARGE_SIZES.values()) == max(SIZES.values())
    assert large["xl-p8"] == small["xl-p8"]           # the size both suites hold is the same task
    for tid, packages in LARGE_SIZES.items():
        pb = XLONG_PLAYBOOKS[tid]
        assert len(pb.modules) == packages * MODULES and pb.modules[-1].path == f"p{packages - 1}/m15.py"
        # a module test per module, a package test per package; the main agent's turns grow with it
        assert len(large[tid].tests) == packages * (MODULES + 1)
        assert large[tid].max_turns == 2 * (3 * MODULES + 2 * (packages - 1) + 2)
    assert repo_variant("xl-p11", 1)[0].tests != large["xl-p11"].tests     # a teacher could run them too


def test_teacher_variants_change_the_wants_and_leave_some_modules_right_on_odd_variants(tmp_path):
    task, pb = repo_variant("xl-p5", 1)
    suite = XLONG_PLAYBOOKS["xl-p5"]
    assert task.task_id == "xl-p5" and task.tests != _tasks()["xl-p5"].tests
    assert sum(a.want != b.want for a, b in zip(pb.modules, suite.modules)) > len(pb.modules) // 2
    right = sum(task.files[m.path] == module_source(m.want) for m in pb.modules)
    assert 0.1 * len(pb.modules) < right < 0.35 * len(pb.modules)
    # Even variants start all broken, as the suite's tasks do (the first report the policy sees).
    even, even_pb = repo_variant("xl-p5", 2)
    assert not any(even.files[m.path] == module_source(m.want) for m in even_pb.modules)
    assert even_pb.modules != pb.modules
    assert repo_variant("xl-p5", 1)[0] == task and repo_variant("xl-p5", 3)[0] != task
    with pytest.raises(ValueError, match="not an xlong task"):
        repo_variant("lh-stats", 0)
    # The teacher finishes a variant (of the mini suite: a few dozen calls) through the real loop.
    mini, mini_pb = repo_variant("xm-p3", 2)
    r = asyncio.run(AgentRun(mini, tmp_path / "ws", RepoTeacher(mini, seed=1, playbook=mini_pb), tmp_path / "j",
                             _harness()).run())
    assert (r.status, r.reward, r.delegations) == ("finished", 1.0, 2)

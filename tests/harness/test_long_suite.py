"""The long suite and its scripted teacher, through the real harness loop (real tools, checker, journal)."""
from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from gyre_hpc.harness.actions import parse_action
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.journal import JournalWriter, load_journal
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.tasks import check_workspace, load_suite
from gyre_hpc.harness.tasks.longhorizon import PLAYBOOKS
from gyre_hpc.harness.teacher import TeacherClient
from gyre_hpc.harness.tokenizer import encode
from gyre_hpc.trees.builder import build_tree

CFG = HarnessConfig(max_new_tokens=176, context_limit=768, subagent_turns=6, tool_output_bytes=192,
                    run_timeout_s=600)


def _tasks():
    return {t.task_id: t for t in load_suite("long")}


def _run(tmp_path, task, client, name="r", cfg=CFG, resume=True):
    run = AgentRun(task, tmp_path / f"ws-{name}", client, tmp_path / f"{name}.jsonl", cfg, run_id=name)
    return asyncio.run(run.run(resume=resume))


def test_long_tasks_start_partial_and_the_playbook_solves_them(tmp_path):
    for task in load_suite("long"):
        ws = task.materialize(tmp_path / task.task_id)
        start = check_workspace(task, ws).score
        assert 0 < start < 0.5, (task.task_id, start)
        pb = PLAYBOOKS[task.task_id]
        for path, _, solution in pb.fixes:
            (ws / path).write_text(solution)
        mid = check_workspace(task, ws).score
        for sub in pb.subtasks:
            (ws / sub.path).write_text(sub.solution)
        assert start < mid < 1.0 and check_workspace(task, ws).score == 1.0, task.task_id


@pytest.mark.parametrize("task_id", ["lh-stats", "lh-inventory"])
def test_teacher_solves_the_long_way_with_retry_delegation_and_compression(tmp_path, task_id):
    task = _tasks()[task_id]
    r = _run(tmp_path, task, TeacherClient(task, seed=0))
    assert (r.status, r.reward, r.retries) == ("finished", 1.0, 1)
    assert r.delegations == len(PLAYBOOKS[task_id].subtasks) and r.compressions >= 1
    assert len(r.calls) >= 12
    roles = {c.role for c in r.calls}
    assert roles == {"main", "subagent", "summary"}
    # every non-summary output is a well-formed call of the one tool-call format
    assert all(parse_action(c.output).tool != "answer" for c in r.calls if c.role != "summary")
    tree = build_tree(r.calls)
    for i, c in enumerate(r.calls):
        assert np.array_equal(tree.path(i), np.concatenate([c.prompt, c.output]))


def test_teacher_seeds_vary_the_detours():
    task = _tasks()["lh-greet"]
    plans = {tuple(TeacherClient(task, seed=s).main) for s in range(8)}
    assert len(plans) > 1


def test_teacher_refuses_a_task_without_playbook():
    task = load_suite("repo")[0]
    with pytest.raises(ValueError, match="no teacher playbook"):
        TeacherClient(task)


class _Garbage:
    """A model that never emits a valid tool call: plain bytes every time."""

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        ids = encode("zzz no call here ")[:max_new_tokens]
        return Completion(tuple(ids), (0.0,) * len(ids))


def test_model_without_a_valid_tool_call_spends_its_turns_and_is_scored(tmp_path):
    task = _tasks()["lh-stats"]
    r = _run(tmp_path, task, _Garbage())
    start = check_workspace(task, task.materialize(tmp_path / "fresh")).score
    assert r.status == "finished" and r.reward == pytest.approx(start) and r.error is None
    assert sum(c.role == "main" for c in r.calls) == task.max_turns
    assert (tmp_path / "ws-r" / "answer.txt").read_bytes().startswith(b"zzz no call here")
    assert load_journal(tmp_path / "r.jsonl").status == "finished"


class _DeletesWorkspace(TeacherClient):
    """The teacher, but at its 6th call the workspace is replaced by a file: the checker cannot run."""

    def __init__(self, task, ws):
        super().__init__(task, seed=0)
        self.ws = ws

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        if self.calls == 5:
            shutil.rmtree(self.ws)
            self.ws.write_text("not a directory")
        return await super().complete(prompt, max_new_tokens, stop, agent=agent)


def test_checker_crash_ends_the_run_failed_with_score_zero_and_journal_kept(tmp_path):
    task = _tasks()["lh-stats"]
    r = _run(tmp_path, task, _DeletesWorkspace(task, tmp_path / "ws-r"))
    assert r.status == "failed" and r.reward == 0.0 and "checker crashed" in r.error
    state = load_journal(tmp_path / "r.jsonl")
    assert state.status == "failed" and state.reward == 0.0 and len(state.calls) == len(r.calls) >= 5


def test_journal_cut_mid_record_resumes_with_every_committed_call(tmp_path):
    task = _tasks()["lh-stats"]
    full = _run(tmp_path, task, TeacherClient(task, seed=0), name="a")
    path = tmp_path / "a.jsonl"
    keep = 8    # 7 committed calls, then half of the 8th call's record
    calls = load_journal(path).calls
    w = JournalWriter.create(path, "a", task.task_id)
    for c in calls[: keep - 1]:
        w.append_call(c)
    committed = path.stat().st_size
    w.append_call(calls[keep - 1])
    w.close()
    with open(path, "r+b") as f:
        f.truncate(committed + (path.stat().st_size - committed) // 2)
    state = load_journal(path)
    assert state.status == "running" and len(state.calls) == keep - 1 and state.torn_bytes > 0
    shutil.rmtree(tmp_path / "ws-a")
    client = TeacherClient(task, seed=0)
    resumed = _run(tmp_path, task, client, name="a")
    assert resumed.status in ("finished", "timeout") and 0.0 <= resumed.reward <= 1.0
    assert resumed.replayed == keep - 1
    for a, b in zip(full.calls[: keep - 1], resumed.calls):
        assert np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
    assert load_journal(path).finished


def test_teacher_speaks_the_run_tokenizer_calls_and_summaries():
    """Calls come from format_action with the given tokenizer (they parse back); a summary
    ends with that tokenizer's eos_id; the prompt is read through its decode (ChatML)."""
    from gyre_hpc.harness.loop import SUMMARY_REQUEST
    from gyre_hpc.harness.tokenizer import ChatFormat
    from gyre_hpc.models.tokenizer import embedded_tokenizer

    tok = embedded_tokenizer()
    chat = ChatFormat(tok)
    task = _tasks()["lh-stats"]
    teacher = TeacherClient(task, seed=0, tokenizer=tok)
    first = chat.message("system", "sys") + chat.message("user", task.spec) + chat.generation_prompt()
    comp = asyncio.run(teacher.complete(first, 176, tok.stop_ids()))
    assert parse_action(comp.output, tok).tool == "list"
    summary = first + list(comp.output) + chat.message("user", SUMMARY_REQUEST) + chat.generation_prompt()
    comp = asyncio.run(teacher.complete(summary, 176, tok.stop_ids()))
    assert comp.output[-1] == tok.eos_id and tok.decode(comp.output).startswith("done: ")


def test_teacher_that_gives_up_stops_at_the_retry_without_delegating(tmp_path):
    task = _tasks()["lh-stats"]
    plain = list(TeacherClient(task, seed=0).main)
    quits = list(TeacherClient(task, seed=0, give_up=1.0).main)
    cut = plain.index(next(s for s in plain if s[0] == "finish")) + 1   # up to the premature finish
    assert quits[:cut] == plain[:cut] and quits[cut:] == [("finish", "all tests pass")]
    r = _run(tmp_path, task, TeacherClient(task, seed=0, give_up=1.0))
    assert r.status == "finished" and r.retries == 1 and r.delegations == 0
    passed = dict(zip(r.check.names, r.check.passed))
    assert passed["mean_simple"] and not passed["median_file"] and 0 < r.reward < 1.0
    with pytest.raises(ValueError, match="give_up"):
        TeacherClient(task, give_up=1.5)

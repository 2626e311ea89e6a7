"""The agent loop's mechanics against a scripted teacher policy (real tools, real journal, real checker)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import pytest

from gyre_hpc.harness.actions import format_action, parse_action
from gyre_hpc.harness.journal import CALL, JournalWriter, _frame, load_journal
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.tasks import load_suite
from gyre_hpc.harness.tokenizer import ChatFormat, encode, split_bytes
from gyre_hpc.models.tokenizer import embedded_tokenizer
from gyre_hpc.trees.builder import build_tree

from scripted import HI_TASK, ScriptClient

# With these numbers the teacher's run compresses exactly once, after the retry's write.
CFG = HarnessConfig(max_new_tokens=32, context_limit=230)


def _run(tmp_path, client, cfg=CFG, task=HI_TASK, name="r", resume=True):
    run = AgentRun(task, tmp_path / f"ws-{name}", client, tmp_path / f"{name}.jsonl", cfg, run_id=name)
    return asyncio.run(run.run(resume=resume))


def test_teacher_run_delegates_retries_compresses_and_journals_every_call(tmp_path):
    r = _run(tmp_path, ScriptClient())
    assert (r.status, r.reward, r.retries, r.compressions, r.delegations) == ("finished", 1.0, 1, 1, 1)
    assert [(c.role, c.agent) for c in r.calls] == [
        ("main", "main"), ("subagent", "sub1"), ("subagent", "sub1"), ("main", "main"),
        ("main", "main"), ("summary", "main"), ("main", "main")]
    assert (tmp_path / "ws-r" / "ok.txt").read_text() == "hi"
    state = load_journal(tmp_path / "r.jsonl")
    assert state.status == "finished" and state.reward == 1.0 and len(state.calls) == 7
    assert all(np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
               for a, b in zip(state.calls, r.calls))
    # the compressed context is intro + summary, within the limit
    last = r.calls[-1]
    assert b"summary: wrote" in split_bytes(last.prompt) and b"retry 1" not in split_bytes(last.prompt)
    # every agent call fits the limit; a summary call sees the full context plus its request
    assert all(len(c.prompt) + CFG.max_new_tokens <= CFG.context_limit for c in r.calls if c.role != "summary")
    tree = build_tree(state.calls, reward=r.reward)
    for i, c in enumerate(state.calls):
        assert np.array_equal(tree.path(i), np.concatenate([c.prompt, c.output]))


def test_retry_branches_from_the_anchor_context(tmp_path):
    r = _run(tmp_path, ScriptClient(), cfg=HarnessConfig(max_new_tokens=32, context_limit=2048))
    first_finish, retried = r.calls[3], r.calls[4]
    anchor = r.calls[0].prompt[:-len(ChatFormat(embedded_tokenizer()).generation_prompt())]  # the intro
    assert np.array_equal(retried.prompt[: anchor.size], anchor)
    assert b"retry 1: 1/2 tests passed" in split_bytes(retried.prompt)
    # a new branch: the first attempt's delegation and finish are not in the retried context
    assert b"sub1:" in split_bytes(first_finish.prompt) and b"sub1:" not in split_bytes(retried.prompt)
    tree = build_tree(r.calls)
    assert tree.n_nodes > 1 and (tree.parent == -1).sum() == 1


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so the loop cannot catch it."""


class CrashAfter(ScriptClient):
    def __init__(self, n):
        super().__init__()
        self.n = n

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        if len(self.prompts) == self.n:
            raise Crash()
        return await super().complete(prompt, max_new_tokens, stop, agent=agent)


def test_crashed_run_resumes_by_replay_without_asking_the_model_again(tmp_path):
    with pytest.raises(Crash):
        _run(tmp_path, CrashAfter(4))
    state = load_journal(tmp_path / "r.jsonl")
    assert state.status == "running" and len(state.calls) == 4
    with open(tmp_path / "r.jsonl", "ab") as f:
        f.write(_frame(CALL, bytes(64))[:30])       # the crash also tore a record
    fresh = ScriptClient()
    r = _run(tmp_path, fresh)
    assert r.replayed == 4 and len(fresh.prompts) == 3     # only the calls after the crash
    assert (r.status, r.reward) == ("finished", 1.0)
    reference = _run(tmp_path, ScriptClient(), name="ref")
    state = load_journal(tmp_path / "r.jsonl")
    assert len(state.calls) == len(reference.calls) == 7
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(state.calls, reference.calls))


def test_resume_that_diverges_restarts_cleanly(tmp_path):
    with pytest.raises(Crash):
        _run(tmp_path, CrashAfter(2))
    path = tmp_path / "r.jsonl"
    calls = load_journal(path).calls
    w = JournalWriter.create(path, "r", HI_TASK.task_id)
    first = calls[0]
    w.append_call(replace(first, prompt=np.insert(first.prompt, 1, 1)))   # not what the loop will ask
    w.append_call(calls[1])
    w.close()
    fresh = ScriptClient()
    r = _run(tmp_path, fresh)
    assert r.replayed == 0 and len(fresh.prompts) == 7 and r.reward == 1.0
    assert len(load_journal(path).calls) == 7


def test_finished_journal_is_not_rerun(tmp_path):
    first = _run(tmp_path, ScriptClient())
    again = ScriptClient()
    r = _run(tmp_path, again)
    assert again.prompts == [] and (r.status, r.reward, len(r.calls)) == ("finished", 1.0, len(first.calls))


def test_timed_out_run_is_scored_from_its_saved_workspace(tmp_path):
    task = next(t for t in load_suite("easy") if t.task_id == "answer-short")
    task = type(task)(**{**task.__dict__, "max_turns": 5})

    def policy(prompt):
        return encode("ok") if b"appended" not in split_bytes(prompt) else format_action("exec", "sleep 100")

    t0 = time.monotonic()
    r = _run(tmp_path, ScriptClient(policy), task=task,
             cfg=HarnessConfig(max_new_tokens=32, context_limit=512, run_timeout_s=1.5))
    assert time.monotonic() - t0 < 8
    assert r.status == "timeout"
    assert r.reward == 0.75 and r.check.passed == (True, True, False, True)   # 'ok' but no digit yet
    state = load_journal(tmp_path / "r.jsonl")
    assert (state.status, state.reward) == ("timeout", 0.75)


def test_slow_model_call_hits_the_wall_clock_too(tmp_path):
    r = _run(tmp_path, ScriptClient(delay_s=5.0), cfg=HarnessConfig(run_timeout_s=0.5))
    assert r.status == "timeout" and len(r.calls) == 0 and r.reward == 0.0


def test_failing_client_gives_a_failed_but_scored_run(tmp_path):
    class Broken(ScriptClient):
        async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
            raise RuntimeError("engine lost")

    r = _run(tmp_path, Broken())
    assert r.status == "failed" and "engine lost" in r.error and r.reward == 0.0
    assert load_journal(tmp_path / "r.jsonl").status == "failed"


def test_tool_errors_are_shown_to_the_model_not_raised(tmp_path):
    def policy(prompt):
        text = split_bytes(prompt)
        if b"outside the workspace" in text:
            return format_action("finish")
        return format_action("read", "../../etc/passwd")

    r = _run(tmp_path, ScriptClient(policy), cfg=HarnessConfig(max_new_tokens=32, context_limit=1024))
    # read (refused), finish (tests fail), retry: read (refused), finish
    assert r.status == "finished" and [parse_action(c.output).tool for c in r.calls] == ["read", "finish"] * 2
    assert b"outside the workspace" in split_bytes(r.calls[1].prompt)


def test_many_runs_share_one_event_loop(tmp_path):
    async def main():
        runs = [AgentRun(HI_TASK, tmp_path / f"ws{k}", ScriptClient(delay_s=0.05), tmp_path / f"j{k}.jsonl", CFG)
                for k in range(4)]
        t0 = time.monotonic()
        results = await asyncio.gather(*(r.run() for r in runs))
        return results, time.monotonic() - t0

    results, wall = asyncio.run(main())
    assert [r.reward for r in results] == [1.0] * 4
    # 7 calls x 0.05 s each would take 1.4 s one after another; concurrently about a quarter of it
    assert wall < sum(r.wall_s for r in results) * 0.75


def test_context_limit_too_small_for_the_header_is_refused(tmp_path):
    with pytest.raises(ValueError, match="rollout.context_limit=120 is too small for task 'say-hi'"):
        AgentRun(HI_TASK, tmp_path / "ws", ScriptClient(), tmp_path / "j.jsonl",
                 HarnessConfig(max_new_tokens=24, context_limit=120))


def test_foreign_workspace_is_never_overwritten(tmp_path):
    ws = tmp_path / "ws-r"
    ws.mkdir()
    (ws / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="ws-r is not empty and has no journal"):
        _run(tmp_path, ScriptClient())
    assert (ws / "precious.txt").read_text() == "keep me"


def test_harness_config_follows_the_rollout_section():
    from gyre_hpc.config import build_config

    cfg = build_config({}, ["rollout.max_new_tokens=32", "rollout.context_limit=300", "rollout.run_timeout_s=9"])
    h = HarnessConfig.from_rollout(cfg.rollout, max_retries=2)
    assert (h.max_new_tokens, h.context_limit, h.run_timeout_s, h.max_retries) == (32, 300, 9.0, 2)
    cfg = build_config({}, ["rollout.max_retries=3", "rollout.max_delegations=0", "rollout.subagent_turns=7",
                            "rollout.tool_output_bytes=99"])
    h = HarnessConfig.from_rollout(cfg.rollout)
    assert (h.max_retries, h.max_delegations, h.subagent_turns, h.tool_output_bytes) == (3, 0, 7, 99)


def test_harness_config_names_a_bad_field():
    with pytest.raises(ValueError, match="HarnessConfig.max_new_tokens=0"):
        HarnessConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="HarnessConfig.max_retries=-1"):
        HarnessConfig(max_retries=-1)


def test_calls_of_one_context_are_held_as_increments_of_the_call_before(tmp_path):
    r = _run(tmp_path, ScriptClient(), cfg=HarnessConfig(max_new_tokens=24, context_limit=2048))
    main = [k for k, c in enumerate(r.calls.increments) if c.role == "main"]
    # The second main call's prompt is the first's prompt + output + tool text: the run holds
    # only the new tokens, and names the first call and the whole of its sequence as shared.
    second = r.calls.increments[main[1]]
    assert (second.base, second.shared) == (main[0], r.calls.seq_len(main[0]))
    assert second.new.size == r.calls[main[1]].prompt.size - r.calls.seq_len(main[0])
    np.testing.assert_array_equal(r.calls[main[1]].prompt[:second.shared], r.calls.seq(main[0]))
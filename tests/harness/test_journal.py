from __future__ import annotations

import json

import numpy as np
import pytest

from gyre_hpc.harness.journal import JournalError, JournalWriter, load_journal
from gyre_hpc.trees.model import ModelCall


def _call(k: int, role: str = "main", agent: str = "main") -> ModelCall:
    rng = np.random.default_rng(k)
    return ModelCall(rng.integers(0, 264, 5 + k), rng.integers(0, 264, 3),
                     rng.normal(size=3).astype(np.float32) - 2, role=role, agent=agent, policy_version=k)


def _same(a: ModelCall, b: ModelCall) -> bool:
    return (np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
            and np.array_equal(a.logprobs, b.logprobs) and (a.role, a.agent, a.policy_version)
            == (b.role, b.agent, b.policy_version))


def test_each_call_is_on_disk_as_soon_as_it_is_appended(tmp_path):
    path = tmp_path / "j.jsonl"
    w = JournalWriter.create(path, "run-7", "task-a")
    calls = [_call(0), _call(1, "subagent", "sub1"), _call(2, "summary")]
    for k, c in enumerate(calls):
        w.append_call(c)
        state = load_journal(path)          # a reader that never saw the writer
        assert len(state.calls) == k + 1 and state.status == "running"
        assert _same(state.calls[-1], c)    # float32 logprobs round-trip exactly
    w.end("timeout", 0.5, 1.25, [True, False])
    state = load_journal(path)
    assert (state.run_id, state.task_id, state.status, state.reward, state.passed) == \
        ("run-7", "task-a", "timeout", 0.5, [True, False])
    assert state.finished and all(_same(a, b) for a, b in zip(state.calls, calls))


@pytest.mark.parametrize("tail", [b'{"type":"call","role":"ma', b'{"type":"call"', b"garbage\n"])
def test_torn_last_line_is_ignored_and_cut_before_the_next_append(tmp_path, tail):
    path = tmp_path / "j.jsonl"
    w = JournalWriter.create(path, "r", "t")
    w.append_call(_call(0))
    w.close()
    with open(path, "ab") as f:
        f.write(tail)
    state = load_journal(path)
    assert len(state.calls) == 1 and state.torn_bytes == len(tail)
    w = JournalWriter.reopen(state)
    w.append_call(_call(1))
    w.end("finished", 1.0, 2.0, [True])
    state = load_journal(path)
    assert state.torn_bytes == 0 and len(state.calls) == 2 and state.status == "finished"
    assert _same(state.calls[1], _call(1))


def test_damage_before_the_last_line_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "j.jsonl"
    w = JournalWriter.create(path, "r", "t")
    for k in range(3):
        w.append_call(_call(k))
    w.close()
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2][:10]
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(JournalError, match=r"j.jsonl line 3 is damaged"):
        load_journal(path)


def test_bad_records_are_named(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_text(json.dumps({"type": "call"}) + "\n")
    with pytest.raises(JournalError, match="does not start with a run record"):
        load_journal(path)
    w = JournalWriter.create(path, "r", "t")
    w._append({"type": "call", "role": "boss", "agent": "main", "policy_version": 0,
               "prompt": [1], "output": [2], "logprobs": [-1.0]})
    w.close()
    with pytest.raises(JournalError, match="line 2: bad call record.*boss"):
        load_journal(path)
    with pytest.raises(JournalError, match="does not exist"):
        load_journal(tmp_path / "missing.jsonl")


def test_a_finished_journal_cannot_be_reopened(tmp_path):
    w = JournalWriter.create(tmp_path / "j.jsonl", "r", "t")
    w.end("finished", 1.0, 0.1, [True])
    with pytest.raises(JournalError, match="already ended"):
        JournalWriter.reopen(load_journal(tmp_path / "j.jsonl"))

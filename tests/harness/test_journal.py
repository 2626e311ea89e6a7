from __future__ import annotations

import json

import numpy as np
import pytest

from gyre_hpc.harness.context import TokenContext
from gyre_hpc.harness.journal import MAGIC, JournalError, JournalWriter, load_journal
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import ModelCall
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_journal


def _call(k: int, role: str = "main", agent: str = "main") -> ModelCall:
    rng = np.random.default_rng(k)
    return ModelCall(rng.integers(0, 264, 5 + k), rng.integers(0, 264, 3),
                     rng.normal(size=3).astype(np.float32) - 2, role=role, agent=agent, policy_version=k)


def _same(a: ModelCall, b: ModelCall) -> bool:
    return (np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
            and np.array_equal(a.logprobs, b.logprobs) and (a.role, a.agent, a.policy_version)
            == (b.role, b.agent, b.policy_version))


def _journal(path, calls, end=False):
    w = JournalWriter.create(path, "r", "t")
    for c in calls:
        w.append_call(c)
    if end:
        w.end("finished", 1.0, 2.0, [True])
    else:
        w.close()
    return path.stat().st_size


def test_each_call_is_on_disk_as_soon_as_it_is_appended(tmp_path):
    path = tmp_path / "j.journal"
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


def test_long_run_stores_unique_tokens_once_and_loads_back_exactly(tmp_path):
    cfg = SyntheticConfig(n_calls=60, context_limit=6000, retry_prob=0.1)
    calls = synthetic_journal(cfg, seed=3)
    size = _journal(tmp_path / "j.journal", calls, end=True)
    state = load_journal(tmp_path / "j.journal")
    assert len(state.calls) == len(calls) and all(_same(a, b) for a, b in zip(state.calls, calls))
    expanded = sum(c.prompt.size + c.output.size for c in calls)
    unique = build_tree(calls).n_tokens     # the trie holds each distinct prefix position once
    assert expanded > 10 * unique
    assert size < 10 * unique  # ~4 bytes per token + 4 per logprob + small record headers
    # A loaded run holds its calls as increments (trees.calls): the unique tokens once, retries
    # included (a retry keeps its prefix by reference, it does not copy it).
    log = state.calls
    held = sum(i.new.nbytes + i.output.nbytes for i in log.increments)
    assert log.unique_tokens <= 2 * unique and held == 4 * log.unique_tokens < 4 * expanded / 5


def test_contexts_never_change_and_branches_share_their_prefix():
    root = TokenContext.of([1, 2, 3])
    a = root.extend([4, 5])
    held = a.array
    b = a.extend(range(5))                   # in place, past a's end
    grown = b.extend(range(100))             # in place too, into a doubled buffer
    c = a.extend([9])                        # a branch: a's segment already goes on with 0..4
    np.testing.assert_array_equal(held, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(a.array, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(c.array, [1, 2, 3, 4, 5, 9])
    np.testing.assert_array_equal(grown.array[:11], [1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0])
    np.testing.assert_array_equal(b.prefix(2).extend([7]).array, [1, 2, 7])
    np.testing.assert_array_equal(c.tail(3), [4, 5, 9])
    np.testing.assert_array_equal(c.extend([8]).prefix(4).extend([6]).array, [1, 2, 3, 4, 6])
    with pytest.raises(ValueError, match="prefix"):
        a.prefix(6)
    # A branch off a long context holds its new tokens only: the prefix stays by reference.
    long = TokenContext.of(range(100_000))
    branch = long.prefix(99_000).extend([7, 7])
    assert branch._seg.data.nbytes < 1024 and len(branch) == 99_002
    np.testing.assert_array_equal(branch.tail(98_999), [98_999, 7, 7])


def test_context_origin_names_the_call_its_prefix_comes_from():
    ctx = TokenContext.of([1, 2, 3])
    assert ctx.origin is None
    seq = ctx.extend([4, 5]).as_call(6)
    assert seq.origin == (6, 5)
    assert seq.extend([8, 9]).origin == (6, 5) and seq.prefix(3).extend([0]).origin == (6, 3)


@pytest.mark.parametrize("cut", [1, 8, 13, 20, -1])
def test_torn_last_record_is_ignored_and_cut_before_the_next_append(tmp_path, cut):
    path = tmp_path / "j.journal"
    one = _journal(path, [_call(0)])
    two = _journal(path, [_call(0), _call(1)])
    keep = one + (cut if cut > 0 else two - one + cut)   # a prefix of the second call record
    path.write_bytes(path.read_bytes()[:keep])
    state = load_journal(path)
    assert len(state.calls) == 1 and state.torn_bytes == keep - one
    w = JournalWriter.reopen(state)
    w.append_call(_call(2))
    w.end("finished", 1.0, 2.0, [True])
    state = load_journal(path)
    assert state.torn_bytes == 0 and len(state.calls) == 2 and state.status == "finished"
    assert _same(state.calls[1], _call(2))


def test_unwritten_last_record_is_torn_too(tmp_path):
    """A crash can grow the file before its data lands: zeros, or a last payload that fails its checksum."""
    path = tmp_path / "j.journal"
    one = _journal(path, [_call(0)])
    two = _journal(path, [_call(0), _call(1)])
    raw = path.read_bytes()
    path.write_bytes(raw[:one] + bytes(two - one))
    assert load_journal(path).torn_bytes == two - one
    path.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))
    assert len(load_journal(path).calls) == 1


@pytest.mark.parametrize("where", ["header", "payload"])
def test_damage_before_the_last_record_is_an_error_naming_file_and_record(tmp_path, where):
    path = tmp_path / "j.journal"
    sizes = [_journal(path, [_call(k) for k in range(n)]) for n in range(4)]
    raw = bytearray(path.read_bytes())
    at = sizes[1] + (2 if where == "header" else 20)   # inside call record 2 (record 3 of the file)
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(JournalError, match=rf"j.journal record 3 \(byte {sizes[1]}\) is damaged: bad {where}"):
        load_journal(path)


def test_record_after_the_end_is_an_error(tmp_path):
    path = tmp_path / "j.journal"
    _journal(path, [_call(0)], end=True)
    with open(path, "r+b") as fh:
        fh.seek(0, 2)
        JournalWriter(path, fh)._append(2, b"")
    with pytest.raises(JournalError, match="record 4 .*a record after the end record"):
        load_journal(path)


def test_bad_records_are_named(tmp_path):
    path = tmp_path / "j.journal"
    path.write_bytes(MAGIC)
    with pytest.raises(JournalError, match="does not start with a run record"):
        load_journal(path)
    path.write_bytes(b"PK\x03\x04 not a journal")
    with pytest.raises(JournalError, match="j.journal is not a gyre journal"):
        load_journal(path)
    w = JournalWriter.create(path, "r", "t")
    w._append(2, b"\x00" * 10)
    w.close()
    with pytest.raises(JournalError, match="record 2: call record of 10 bytes is too short"):
        load_journal(path)
    w = JournalWriter.create(path, "r", "t")
    w.append_call(_call(0))
    w._append(2, (5).to_bytes(4, "little", signed=True) + bytes(19))   # base call 5 does not exist
    w.close()
    with pytest.raises(JournalError, match="record 3: bad call record.*base call 5"):
        load_journal(path)
    with pytest.raises(JournalError, match="does not exist"):
        load_journal(tmp_path / "missing.journal")


def test_old_json_lines_journal_is_refused_by_name(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"type": "run", "run_id": "r", "task_id": "t", "format": 1}) + "\n")
    with pytest.raises(JournalError, match=r"old.jsonl is in the old JSON-lines format \(format 1\)"):
        load_journal(path)


def test_a_finished_journal_cannot_be_reopened(tmp_path):
    w = JournalWriter.create(tmp_path / "j.journal", "r", "t")
    w.end("finished", 1.0, 0.1, [True])
    with pytest.raises(JournalError, match="already ended"):
        JournalWriter.reopen(load_journal(tmp_path / "j.journal"))

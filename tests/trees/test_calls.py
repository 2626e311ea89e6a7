"""CallLog: a run's calls as increments, materialised whole on demand."""
import numpy as np
import pytest

from gyre_hpc.trees.calls import CallIncrement, CallLog, common_prefix
from gyre_hpc.trees.model import ModelCall


def inc(base, shared, new, out=(), role="main", agent="main"):
    return CallIncrement(base, shared, np.array(new), np.array(out), -np.ones(len(out)), role, agent)


def test_prompts_materialise_through_chains_of_partial_prefixes():
    log = CallLog([inc(-1, 0, [1, 2, 3], [4, 5]),          # seq 0: 1 2 3 4 5
                   inc(0, 4, [9], [8]),                    # prompt 1 2 3 4 9, seq ... 8
                   inc(1, 2, [7], [6, 6]),                 # prompt 1 2 7 (inside call 0's prompt)
                   inc(1, 6, [], [0]),                     # prompt = all of seq 1, empty new
                   inc(3, 7, [5])])                        # prompt 1 2 3 4 9 8 0 5
    assert [log.prompt(k).tolist() for k in range(5)] == [
        [1, 2, 3], [1, 2, 3, 4, 9], [1, 2, 7], [1, 2, 3, 4, 9, 8], [1, 2, 3, 4, 9, 8, 0, 5]]
    assert log.seq(4).tolist() == [1, 2, 3, 4, 9, 8, 0, 5]
    assert log[2].output.tolist() == [6, 6] and [c.prompt.size for c in log[3:]] == [6, 8]
    assert log.unique_tokens == 3 + 2 + 1 + 1 + 1 + 2 + 1 + 1 and log.seq_len(1) == 6
    assert log.count("main", "main") == 5 and log.count("sub1", "subagent") == 0


def test_append_refuses_a_base_the_log_does_not_hold():
    log = CallLog([inc(-1, 0, [1], [2])])
    with pytest.raises(ValueError, match="base call 1 is not an earlier call"):
        log.append(inc(1, 1, [3]))
    with pytest.raises(ValueError, match="shares 3 tokens with call 0 of 2"):
        log.append(inc(0, 3, [3]))
    with pytest.raises(ValueError, match="shares 2 tokens with call -1"):
        inc(-1, 2, [3])


def test_whole_calls_become_increments_on_their_longest_shared_prefix(make_journal):
    journal = make_journal(3)
    log = CallLog.of(journal)
    for k, c in enumerate(journal):
        got = log[k]
        assert isinstance(got, ModelCall) and np.array_equal(got.prompt, c.prompt)
        assert np.array_equal(got.output, c.output) and (got.role, got.agent) == (c.role, c.agent)
        i = log.increments[k]
        if i.base >= 0:     # the shared prefix is really shared, and the search found all of it
            seq = log.seq(i.base)
            assert i.shared == common_prefix(seq, c.prompt) > 0
    assert log.unique_tokens < sum(c.prompt.size + c.output.size for c in journal) / 3

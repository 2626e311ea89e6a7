import numpy as np
import pytest

from gyre_hpc.trees.admission import admission_order, admit
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import ROLE_CODE, ModelCall


def c(prompt, output, role="main", agent="main"):
    return ModelCall(prompt, output, -np.ones(len(output)), role=role, agent=agent)


JOURNAL = [
    c([1, 2], [3]),                       # 0 main, prefix of call 1
    c([1, 2, 3, 9], [4]),                 # 1 main, maximal
    c([1, 2, 3, 9, 4, 9], [5, 5], "summary"),  # 2 summary
    c([8, 1], [6], "subagent", "s0"),     # 3 subagent (own root)
    c([8, 1, 6, 9], [7], "subagent", "s0"),  # 4 subagent
    c([1, 7], [3]),                       # 5 main, maximal
]


def test_priority_is_main_then_subagent_then_summary_maximal_paths_first():
    tree = build_tree(JOURNAL)
    assert admission_order(tree) == [1, 5, 0, 4, 3, 2]


def test_admit_keeps_k_paths_and_records_the_rest():
    tree = admit(build_tree(JOURNAL), max_paths=3)
    assert tree.n_paths == 3 and tree.dropped_calls == [2, 3, 4]
    assert [int(r) for r in tree.call_role] == [ROLE_CODE["main"]] * 3
    kept = [0, 1, 5]
    for i, orig in enumerate(kept):
        np.testing.assert_array_equal(tree.path(i), np.concatenate([JOURNAL[orig].prompt, JOURNAL[orig].output]))
    # The sub-agent root and the summary branch are gone, nothing else.
    assert tree.n_tokens == len([1, 2, 3, 9, 4]) + len([7, 3])
    assert np.all(tree.parent < np.arange(tree.n_nodes))
    np.testing.assert_array_equal(tree.node_start, np.concatenate([[0], np.cumsum(tree.node_len)[:-1]]))


def test_dropped_prefix_call_keeps_its_tokens_trained_on_the_kept_path():
    tree = admit(build_tree(JOURNAL), max_paths=2)
    assert tree.dropped_calls == [0, 2, 3, 4]
    # Call 0's output "3" sits on call 1's kept path, in the very context it was sampled in.
    np.testing.assert_array_equal(tree.path(0), [1, 2, 3, 9, 4])
    assert tree.trained.sum() == 3  # 3 and 4 on the first path, 3 after 1 7


def test_admitting_again_maps_to_original_journal_indices():
    once = admit(build_tree(JOURNAL), max_paths=4)
    assert once.dropped_calls == [2, 3]
    twice = admit(once, max_paths=2)
    assert twice.dropped_calls == [0, 2, 3, 4]
    assert twice.call_agent == ["main", "main"]


def test_admit_within_budget_is_the_same_tree_and_bad_k_names_the_field():
    tree = build_tree(JOURNAL)
    assert admit(tree, 6) is tree and tree.dropped_calls == []
    with pytest.raises(ValueError, match="max_paths_per_run"):
        admit(tree, 0)

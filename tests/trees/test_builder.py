import numpy as np
import pytest

from gyre_hpc.trees.builder import build_tree, node_depth, subtree_end_nodes
from gyre_hpc.trees.calls import CallIncrement, CallLog, common_prefix
from gyre_hpc.trees.model import ROLE_CODE, ModelCall
from gyre_hpc.trees.reference import reference_targets
from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_journal


def call(prompt, output, lps=None, **kw):
    lps = -np.arange(1, len(output) + 1) / 10 if lps is None else lps
    return ModelCall(prompt=prompt, output=output, logprobs=lps, **kw)


def trained_at(tree, call_index):
    """trained flags and logprobs along one call's path."""
    idx = np.concatenate([np.arange(tree.node_start[n], tree.node_start[n] + tree.node_len[n])
                          for n in tree.node_path(call_index)])
    return tree.trained[idx], tree.logprobs[idx]


@pytest.mark.parametrize("seed", range(6))
def test_path_round_trip_is_exactly_prompt_plus_output(seed, make_journal):
    journal = make_journal(seed)
    tree = build_tree(journal)
    assert tree.n_paths == len(journal)
    for i, c in enumerate(journal):
        np.testing.assert_array_equal(tree.path(i), np.concatenate([c.prompt, c.output]))


@pytest.mark.parametrize("seed", range(6))
def test_layout_is_preorder_with_contiguous_subtrees(seed, make_journal):
    tree = build_tree(make_journal(seed))
    assert np.all(tree.parent < np.arange(tree.n_nodes))
    np.testing.assert_array_equal(tree.node_start, np.concatenate([[0], np.cumsum(tree.node_len)[:-1]]))
    assert tree.node_len.min() >= 1 and tree.node_start[-1] + tree.node_len[-1] == tree.n_tokens
    end = subtree_end_nodes(tree)
    for i in range(tree.n_nodes):  # every node in (i, end[i]) has i as an ancestor, none after
        for j in range(i + 1, tree.n_nodes):
            a, inside = j, False
            while a >= 0:
                inside |= a == i
                a = tree.parent[a]
            assert inside == (j < end[i])
    depth = node_depth(tree)
    for c in range(tree.n_paths):
        last = tree.call_node[c]
        assert depth[last] + tree.node_len[last] == tree.path(c).size


@pytest.mark.parametrize("seed", range(6))
def test_trained_tokens_match_the_independent_reference_rule(seed, make_journal):
    journal = make_journal(seed)
    tree = build_tree(journal)
    _assert_samples_match_reference(tree, journal)


def _assert_samples_match_reference(tree, journal):
    """Trained positions, their multiplicities and every sample's logprob agree with the
    reference's independent trie, under both rules."""
    once = reference_targets(journal, shared_targets="once")
    each = reference_targets(journal, shared_targets="per_sample")
    assert int(tree.trained.sum()) == len(once) == len(each)
    assert all(t.multiplicity == 1 for t in once)
    np.testing.assert_allclose(np.sort(tree.logprobs[tree.trained]), np.sort([t.behaviour_logps[0] for t in once]))
    np.testing.assert_array_equal(np.sort(tree.multiplicity[tree.trained]), np.sort([t.multiplicity for t in each]))
    np.testing.assert_allclose(np.sort(tree.sample_logprob), np.sort([lp for t in each for lp in t.behaviour_logps]))
    for rule, ref in (("once", once), ("per_sample", each)):
        assert tree.n_targets(rule).tolist() == [sum(t.multiplicity for t in ref)]


def test_next_prompt_extending_previous_output_trains_it_once():
    a = call([1, 2], [3, 4])
    b = call([1, 2, 3, 4, 9, 9], [5])  # prompt = previous prompt + output + tool text
    tree = build_tree([a, b])
    trained, lps = trained_at(tree, 1)
    np.testing.assert_array_equal(trained, [0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(lps, [0, 0, -0.1, -0.2, 0, 0, -0.1], rtol=1e-6)
    assert tree.trained.sum() == 3 and tree.n_tokens == 7


def test_identical_retry_is_trained_once_with_first_calls_logprobs():
    a = call([1, 2], [3, 4], [-0.5, -0.6])
    retry = call([1, 2], [3, 4], [-0.9, -0.8])
    tree = build_tree([a, retry])
    assert tree.n_tokens == 4 and tree.trained.sum() == 2
    np.testing.assert_allclose(tree.logprobs[tree.trained], [-0.5, -0.6], rtol=1e-6)
    assert tree.call_node[0] == tree.call_node[1]


def test_retry_with_different_output_branches_at_the_divergence():
    tree = build_tree([call([1, 2], [3, 4]), call([1, 2], [3, 5])])
    assert tree.n_nodes == 3 and list(tree.parent) == [-1, 0, 0]
    assert tree.trained.sum() == 3  # 3 shared, then 4 and 5 each once


def test_prompt_repeating_an_earlier_output_elsewhere_is_context():
    summary = call([1, 2, 3], [7, 8])
    fresh = call([1, 9, 7, 8], [6])  # the summary quoted at a different trie position
    tree = build_tree([summary, fresh])
    trained, _ = trained_at(tree, 1)
    np.testing.assert_array_equal(trained, [0, 0, 0, 0, 1])


def test_prompt_token_later_generated_at_the_same_position_is_trained():
    # The harness wrote "3" into call 0's context; call 1 generated "3" in exactly that context.
    tree = build_tree([call([1, 2, 3], []), call([1, 2], [3], [-0.3])])
    assert tree.trained.tolist() == [False, False, True]
    assert np.isclose(tree.logprobs[2], -0.3)


def test_empty_output_trains_nothing_and_ends_at_its_prompt():
    tree = build_tree([call([1, 2, 3], [4]), call([1, 2], [])])
    np.testing.assert_array_equal(tree.path(1), [1, 2])
    assert tree.trained.sum() == 1
    assert tree.node_len[tree.call_node[1]] == 2  # the node was split at the prompt end


def test_prompt_sharing_nothing_starts_a_new_root():
    tree = build_tree([call([1, 2], [3]), call([5, 6], [7], role="subagent", agent="s0")])
    assert list(tree.parent) == [-1, -1]
    assert tree.node_role.tolist() == [ROLE_CODE["main"], ROLE_CODE["subagent"]]
    assert tree.call_agent == ["main", "s0"]


def test_call_ending_inside_an_existing_node_splits_it_and_keeps_earlier_ends():
    tree = build_tree([call([1, 2, 3], [4, 5]), call([1, 2], [9])])
    np.testing.assert_array_equal(tree.path(0), [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(tree.path(1), [1, 2, 9])


def test_run_metadata_is_kept():
    tree = build_tree([call([1], [2])], run_id="r", task_id="t", reward=0.5, status="timeout",
                      policy_version=3, wall_s=1.5)
    assert (tree.run_id, tree.task_id, tree.reward, tree.status, tree.policy_version, tree.wall_s) == \
        ("r", "t", 0.5, "timeout", 3, 1.5)


def test_bad_input_names_the_call_or_field():
    with pytest.raises(ValueError, match="call 1: empty prompt"):
        build_tree([call([1], [2]), call([], [2])], run_id="r")
    with pytest.raises(ValueError, match="status='lost'"):
        build_tree([call([1], [2])], status="lost")
    with pytest.raises(ValueError, match="call 0: logprobs contain NaN"):
        build_tree([call([1], [2], [np.nan])])
    with pytest.raises(ValueError, match="reward"):
        build_tree([call([1], [2])], reward=float("nan"))


def test_empty_journal_is_an_empty_tree():
    tree = build_tree([])
    assert tree.n_tokens == 0 and tree.n_nodes == 0 and tree.n_paths == 0


@pytest.mark.parametrize("seed", range(40))
def test_coinciding_tokens_on_a_tiny_alphabet(seed, make_coincidences):
    journal = make_coincidences(seed)
    tree = build_tree(journal)
    for i, c in enumerate(journal):
        np.testing.assert_array_equal(tree.path(i), np.concatenate([c.prompt, c.output]))
    _assert_samples_match_reference(tree, journal)
    assert np.all(tree.logprobs[~tree.trained] == 0)


def _same_tree(a, b):
    import dataclasses

    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def _random_increments(journal, rng) -> CallLog:
    """The journal as increments on arbitrary valid bases: any earlier call, sharing any part of
    the prefix it has in common with the prompt (positions mid-node, at node ends, at the root)."""
    log = CallLog()
    seqs = []
    for c in journal:
        base, shared = -1, 0
        if seqs and rng.random() < 0.9:
            base = int(rng.integers(len(seqs)))
            shared = int(rng.integers(0, common_prefix(seqs[base], c.prompt) + 1))
            base = base if shared else -1
        log.append(CallIncrement(base, shared, c.prompt[shared:], c.output, c.logprobs, c.role, c.agent,
                                 c.policy_version))
        seqs.append(np.concatenate([c.prompt, c.output]))
    return log


@pytest.mark.parametrize("seed", range(12))
def test_tree_from_increments_is_bitwise_the_tree_from_whole_prompts(seed, make_journal, make_coincidences):
    rng = np.random.default_rng(seed)
    long = synthetic_journal(SyntheticConfig(n_calls=80, retry_prob=0.2, empty_output_prob=0.05), seed=seed)
    for journal in (make_journal(seed), make_coincidences(seed), long):
        meta = dict(run_id="r", task_id="t", reward=0.5, status="timeout", policy_version=3, wall_s=1.5)
        whole = build_tree(journal, **meta)
        for log in (CallLog.of(journal), _random_increments(journal, rng)):
            assert [np.array_equal(log[k].prompt, c.prompt) for k, c in enumerate(journal)] == [True] * len(journal)
            _same_tree(build_tree(log, **meta), whole)


def test_increments_with_an_empty_prompt_are_refused_naming_the_call():
    log = CallLog([CallIncrement(-1, 0, [1], [2], [-0.1]), CallIncrement(-1, 0, [], [2], [-0.1])])
    with pytest.raises(ValueError, match="call 1: empty prompt"):
        build_tree(log, run_id="r")

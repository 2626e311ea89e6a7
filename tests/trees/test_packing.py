import numpy as np
import pytest
import torch

from gyre_hpc.models.tiny_lm import PAD_ID
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import ModelCall
from gyre_hpc.trees.packing import collate, pack


def _trees(make_journal, n=3):
    return [build_tree(make_journal(s), run_id=f"r{s}") for s in range(n)]


def _path_of(row, j):
    """Row indices of token j's path (root first) by following predecessors."""
    path = []
    while j >= 0:
        path.append(j)
        j = row.pred_index[j]
    return path[::-1]


@pytest.mark.parametrize("row_tokens", [150, 400, 100_000])
def test_every_trained_token_is_owned_once_with_its_whole_path(make_journal, row_tokens):
    trees = _trees(make_journal)
    rows = pack(trees, row_tokens)
    assert all(r.n_tokens <= row_tokens for r in rows)
    owned = {}
    for row in rows:
        for j in np.flatnonzero(row.loss_mask):
            path = _path_of(row, j)
            # The path seen in the row is a real prefix of the tree, at positions 0..depth.
            np.testing.assert_array_equal(row.position_ids[path], np.arange(len(path)))
            key = (int(row.run_index[j]), tuple(row.input_ids[path].tolist()))
            assert key not in owned
            owned[key] = row.behaviour_logprobs[j]
    expected = {}
    for r, tree in enumerate(trees):
        for c in range(tree.n_paths):
            nodes = tree.node_path(c)
            idx = np.concatenate([np.arange(tree.node_start[n], tree.node_start[n] + tree.node_len[n]) for n in nodes])
            for k in np.flatnonzero(tree.trained[idx]):
                expected[(r, tuple(tree.tokens[idx[:k + 1]].tolist()))] = tree.logprobs[idx[k]]
    assert owned.keys() == expected.keys()
    assert all(owned[k] == expected[k] for k in owned)


def test_small_trees_share_a_row_and_stay_apart():
    a = build_tree([ModelCall([1, 2], [3], [-0.1])])
    b = build_tree([ModelCall([4], [5, 6], [-0.2, -0.3])])
    (row,) = pack([a, b], 16)
    np.testing.assert_array_equal(row.input_ids, [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(row.subtree_end, [3, 3, 3, 6, 6, 6])
    np.testing.assert_array_equal(row.pred_index, [-1, 0, 1, -1, 3, 4])
    np.testing.assert_array_equal(row.run_index, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(row.loss_mask, [0, 0, 1, 0, 1, 1])


def test_branching_tree_positions_and_predecessors():
    # 1 2 | 3 4 (call 0) and 1 2 | 5 (call 1): two children of the node [1 2].
    tree = build_tree([ModelCall([1, 2], [3, 4], [-1, -1]), ModelCall([1, 2], [5], [-1])])
    (row,) = pack([tree], 16)
    np.testing.assert_array_equal(row.input_ids, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(row.position_ids, [0, 1, 2, 3, 2])
    np.testing.assert_array_equal(row.pred_index, [-1, 0, 1, 2, 1])  # 5's predecessor is 2, not 4
    np.testing.assert_array_equal(row.subtree_end, [5, 5, 4, 4, 5])


def test_split_row_repeats_ancestors_as_untrained_context():
    tree = build_tree([ModelCall([1, 2, 3], [4, 5], [-1, -1]), ModelCall([1, 2, 3], [6, 7], [-1, -1])])
    rows = pack([tree], 5)
    # Row 0: 1 2 3 4 5; row 1 repeats 1 2 3 as context, then owns 6 7.
    np.testing.assert_array_equal(rows[1].input_ids, [1, 2, 3, 6, 7])
    np.testing.assert_array_equal(rows[1].loss_mask, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(rows[1].position_ids, [0, 1, 2, 3, 4])


def test_node_that_does_not_fit_starts_the_next_row_whole():
    tree = build_tree([ModelCall([1, 2, 3], [4, 5], [-1, -1]), ModelCall([1, 2, 3], [6, 7, 8], [-1, -2, -3])])
    rows = pack([tree], 6)
    # Row 0 is left one short rather than cutting node [6 7 8]; row 1 repeats its ancestors.
    np.testing.assert_array_equal(rows[0].input_ids, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(rows[1].input_ids, [1, 2, 3, 6, 7, 8])
    np.testing.assert_array_equal(rows[1].loss_mask, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(rows[1].pred_index, [-1, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(rows[1].position_ids, [0, 1, 2, 3, 4, 5])
    np.testing.assert_allclose(rows[1].behaviour_logprobs[3:], [-1, -2, -3])


def test_single_paths_pack_without_repeating_anything(make_journal):
    journal = make_journal(0)
    paths = [build_tree([c]) for c in journal]
    rows = pack(paths, 400)
    assert sum(r.n_tokens for r in rows) == sum(c.prompt.size + c.output.size for c in journal)


def test_tree_with_a_path_deeper_than_a_row_gets_one_whole_row(make_journal):
    deep = build_tree([ModelCall(list(range(10)), [1], [-1]), ModelCall(list(range(10)), [2, 3], [-1, -2])],
                      run_id="deep")
    small = build_tree([ModelCall([4], [5], [-0.5])])
    rows = pack([small, deep, small], 8)
    # The deep tree is not split (split rows would repeat its ancestors): one row of 13 tokens.
    assert [r.n_tokens for r in rows] == [2, 13, 2]
    np.testing.assert_array_equal(rows[1].input_ids, list(range(10)) + [1, 2, 3])
    np.testing.assert_array_equal(rows[1].loss_mask, [0] * 10 + [1, 1, 1])
    np.testing.assert_array_equal(rows[1].pred_index[10:], [9, 9, 11])
    trees = [build_tree(make_journal(s)) for s in range(2)]
    shallowest = min(max(t.path(c).size for c in range(t.n_paths)) for t in trees)
    rows = pack(trees, shallowest - 1)
    assert [r.n_tokens for r in rows] == [t.n_tokens for t in trees]
    with pytest.raises(ValueError, match="row_tokens=1 must be >= 2"):
        pack([deep], 1)


def test_collate_pads_with_tokens_that_see_only_themselves():
    a = build_tree([ModelCall([1, 2], [3], [-0.5])])
    b = build_tree([ModelCall([4], [5], [-0.5])])
    rows = pack([a], 16) + pack([b], 16)
    batch = collate(rows)
    assert batch.shape == (2, 3)
    assert batch.input_ids[1, 2] == PAD_ID and not batch.loss_mask[1, 2]
    assert batch.subtree_end[1, 2] == 3 and batch.run_index[1, 2] == -1
    assert batch.input_ids.dtype == torch.int64
    with pytest.raises(ValueError, match="pad_to=2 is shorter"):
        collate(rows, pad_to=2)
    with pytest.raises(ValueError, match="no rows"):
        collate([])

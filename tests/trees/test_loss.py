"""The packed tree loss against the call-by-call reference, in float64."""
import numpy as np
import pytest
import torch

from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.trees.admission import admit
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.loss import StepWeights, clipped_pg_loss, group_advantages, packed_loss, step_denominator
from gyre_hpc.trees.packing import collate, pack
from gyre_hpc.trees.reference import reference_loss

CLIP = 0.2
REWARDS = [0.0, 0.5, 1.0, 0.25, 0.25, 0.75]
TASKS = ["a", "a", "a", "b", "b", "b"]


def _journals(make_journal, n=6, n_calls=24):
    journals = [make_journal(100 + i, n_calls=n_calls) for i in range(n)]
    calls = [c for j in journals for c in j]
    # The shapes the reference must agree on are really present: compressions, sub-agents,
    # retries from the same context, empty outputs, a second root.
    assert {c.role for c in calls} == {"main", "subagent", "summary"}
    assert any(len({c.prompt.tobytes() for c in j}) < len(j) for j in journals)
    assert any(c.output.size == 0 for c in calls)
    assert all(any(c.prompt[0] != j[0].prompt[0] for c in j) for j in journals)
    return journals


def _trees(journals):
    return [build_tree(j, run_id=f"r{i}", task_id=TASKS[i], reward=REWARDS[i]) for i, j in enumerate(journals)]


def _grads(model):
    g = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return g


def _reference(model, journals, kept=None, rule="per_sample", averaging="run"):
    model.zero_grad()
    loss, weights = reference_loss(model, journals, REWARDS[:len(journals)], TASKS[:len(journals)], CLIP, kept=kept,
                                   shared_targets=rule, averaging=averaging)
    loss.backward()
    return loss.detach(), _grads(model), weights


def _packed(model, trees, rows, micro_batches, rule="per_sample", averaging="run"):
    """Loss summed over micro-batches (each a list of row indices), grads accumulated."""
    weights = StepWeights.from_trees(trees, rule, averaging)
    total = torch.zeros((), dtype=torch.float64)
    for mb in micro_batches:
        loss = packed_loss(model, collate([rows[i] for i in mb]), weights, CLIP, attention="sdpa")
        loss.backward()
        total += loss.detach()
    return total, _grads(model)


def _assert_close(loss, grads, ref_loss, ref_grads, rel=1e-10):
    assert abs(loss.item() - ref_loss.item()) <= rel * abs(ref_loss.item())
    for g, r in zip(grads, ref_grads):
        assert torch.linalg.vector_norm(g - r) <= rel * torch.linalg.vector_norm(r)


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=11).double()


@pytest.mark.parametrize("rule,averaging", [("per_sample", "run"), ("once", "run"), ("per_sample", "global"),
                                            ("once", "global")])
def test_packed_loss_and_grads_equal_per_call_reference(model, make_journal, rule, averaging):
    journals = _journals(make_journal)
    trees = _trees(journals)
    ref_loss, ref_grads, ref_w = _reference(model, journals, rule=rule, averaging=averaging)
    np.testing.assert_array_equal(StepWeights.from_trees(trees, rule).run_tokens, ref_w.run_tokens)
    rows = pack(trees, row_tokens=4096, shared_targets=rule)  # roomy rows: several whole trees per row
    assert max(r.n_tokens for r in rows) <= 4096
    loss, grads = _packed(model, trees, rows, [list(range(len(rows)))], rule, averaging)
    assert ref_loss.abs() > 1e-3  # a loss that could not fail would be 0
    _assert_close(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("rule", ["per_sample", "once"])
def test_rows_split_at_node_boundaries_still_equal_reference(model, make_journal, rule):
    journals = _journals(make_journal)
    trees = _trees(journals)
    ref_loss, ref_grads, _ = _reference(model, journals, rule=rule)
    longest_path = max(t.path(c).size for t in trees for c in range(t.n_paths))
    # Far shorter than a tree: splits, context repeated.
    rows = pack(trees, row_tokens=longest_path + 8, shared_targets=rule)
    assert longest_path + 8 < min(t.n_tokens for t in trees)
    assert len(rows) > len(trees) * 2
    assert sum(r.n_loss_tokens for r in rows) == sum(int(t.trained.sum()) for t in trees)
    assert sum(r.n_tokens for r in rows) > sum(t.n_tokens for t in trees)  # context was repeated
    assert sum(r.n_samples for r in rows) == sum(int(t.n_targets(rule).sum()) for t in trees)
    loss, grads = _packed(model, trees, rows, [[i] for i in range(len(rows))], rule)
    _assert_close(loss, grads, ref_loss, ref_grads)


@pytest.mark.parametrize("rule,averaging", [("per_sample", "run"), ("once", "global")])
def test_micro_batch_and_replica_splits_give_the_same_gradient(model, make_journal, rule, averaging):
    trees = _trees(_journals(make_journal))
    rows = pack(trees, row_tokens=160, shared_targets=rule)
    n = len(rows)
    full_loss, full = _packed(model, trees, rows, [list(range(n))], rule, averaging)
    rng = np.random.default_rng(0)
    perm = rng.permutation(n).tolist()
    # Replica A takes a third of the rows in two micro-batches, replica B the rest in three;
    # the allreduce is a SUM of their gradients.
    a, b = perm[: n // 3], perm[n // 3:]
    loss_a, grads_a = _packed(model, trees, rows, [a[: len(a) // 2], a[len(a) // 2:]], rule, averaging)
    loss_b, grads_b = _packed(model, trees, rows, [b[i::3] for i in range(3)], rule, averaging)
    _assert_close(loss_a + loss_b, [x + y for x, y in zip(grads_a, grads_b)], full_loss, full, rel=1e-12)


@pytest.mark.parametrize("rule", ["per_sample", "once"])
def test_admitted_trees_equal_reference_over_kept_calls(model, make_journal, rule):
    journals = _journals(make_journal, n=3)
    trees = [admit(t, max_paths=5) for t in _trees(journals)]
    kept = [sorted(set(range(len(j))) - set(t.dropped_calls)) for j, t in zip(journals, trees)]
    assert all(len(k) == 5 for k in kept)
    ref_loss, ref_grads, _ = _reference(model, journals, kept=kept, rule=rule)
    rows = pack(trees, 256, shared_targets=rule)
    loss, grads = _packed(model, trees, rows, [[i] for i in range(len(rows))], rule)
    _assert_close(loss, grads, ref_loss, ref_grads)


def test_group_advantages_normalise_within_task_and_guard_zero_std():
    adv = group_advantages([0.0, 1.0, 0.5, 0.5, 3.0], ["a", "a", "b", "b", "c"])
    np.testing.assert_allclose(adv, [-1.0, 1.0, 0.0, 0.0, 0.0])
    adv = group_advantages([0.0, 0.25, 1.0], ["t"] * 3)
    r = np.array([0.0, 0.25, 1.0])
    np.testing.assert_allclose(adv, (r - r.mean()) / r.std())
    with pytest.raises(ValueError, match="3 rewards for 2 task ids"):
        group_advantages([1, 2, 3], ["a", "b"])


def test_step_weights_average_within_run_then_across_runs():
    w = StepWeights.from_counts([0.0, 1.0, 1.0], ["a", "a", "a"], [4, 0, 2])
    assert w.n_runs == 2  # the run with nothing to train does not dilute the others
    np.testing.assert_allclose(w.run_weight, [1 / 8, 0.0, 1 / 4])
    g = StepWeights.from_counts([0.0, 1.0, 1.0], ["a", "a", "a"], [4, 0, 2], averaging="global")
    np.testing.assert_allclose(g.run_weight, [1 / 6, 0.0, 1 / 6])   # one mean over the step's 6 targets
    assert step_denominator([4, 0, 2], "run") == 2 and step_denominator([4, 0, 2], "global") == 6
    with pytest.raises(ValueError, match="averaging='mean': valid rules are run, global"):
        StepWeights.from_counts([0.0], ["a"], [1], averaging="mean")


def test_clipped_loss_clips_only_in_the_direction_that_helps():
    lp = torch.log(torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], dtype=torch.float64))
    old = torch.zeros(5, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    per = [clipped_pg_loss(lp[i:i + 1], old[i:i + 1], adv[i:i + 1], torch.ones(1, dtype=torch.float64), 0.2).item()
           for i in range(5)]
    # ratio 1.5 with A>0 is capped at 1.2; with A<0 the unclipped 1.5 is the pessimistic one;
    # ratio 0.5 with A>0 keeps 0.5; with A<0 is capped at 0.8; 1.1 is inside the range.
    np.testing.assert_allclose(per, [-1.2, 1.5, -0.5, 0.8, -1.1])


@pytest.mark.parametrize("rule", ["per_sample", "once"])
def test_coinciding_tokens_equal_reference_with_admission_and_tiny_rows(model, make_coincidences, rule):
    journals = [make_coincidences(200 + i) for i in range(4)]
    rewards, tasks = [0.0, 1.0, 0.3, 0.9], ["a", "a", "b", "b"]
    trees = [admit(build_tree(j, task_id=t, reward=r), max_paths=12) for j, t, r in zip(journals, tasks, rewards)]
    kept = [sorted(set(range(len(j))) - set(t.dropped_calls)) for j, t in zip(journals, trees)]
    assert any(t.multiplicity.max() > 1 for t in trees)   # positions several calls sampled
    model.zero_grad()
    ref_loss, _ = reference_loss(model, journals, rewards, tasks, CLIP, kept=kept, shared_targets=rule)
    ref_loss.backward()
    ref_grads = _grads(model)
    longest = max(t.path(c).size for t in trees for c in range(t.n_paths))
    rows = pack(trees, longest, shared_targets=rule)  # as tight as it gets: many splits
    weights = StepWeights.from_trees(trees, rule)
    total = torch.zeros((), dtype=torch.float64)
    for row in rows:
        loss = packed_loss(model, collate([row]), weights, CLIP, attention="sdpa")
        loss.backward()
        total += loss.detach()
    _assert_close(total, _grads(model), ref_loss.detach(), ref_grads)

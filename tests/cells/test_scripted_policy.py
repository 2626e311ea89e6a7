"""The scripted policy: every elastic cell flips every step, both directions, idempotent within a step."""
from gyre_hpc.sched.registry import get_policy
from gyre_hpc.sched.scripted import scripted_policy, wanted_role
from gyre_hpc.sched.state import CellKind, CellState, ClusterState, Role


def state(step, roles, kinds=None, switching=()):
    kinds = kinds or [CellKind.CORE] + [CellKind.ELASTIC] * (len(roles) - 1)
    return ClusterState(time=0.0, step=step, cells=tuple(
        CellState(cell=i, kind=k, role=r, switching=i in switching) for i, (k, r) in enumerate(zip(kinds, roles))))


def apply(roles, changes):
    roles = list(roles)
    for ch in changes:
        roles[ch.cell] = ch.to
    return roles


def test_every_elastic_cell_flips_every_step_in_alternating_directions():
    roles = [Role.TRAIN, Role.ROLLOUT, Role.ROLLOUT, Role.ROLLOUT]
    history = []
    for step in range(1, 7):
        changes = scripted_policy(state(step, roles))
        roles = apply(roles, changes)
        history.append(roles)
        assert scripted_policy(state(step, roles)) == []       # asking again mid-step: nothing
    for prev, cur in zip(history, history[1:]):
        assert all(prev[c] is not cur[c] for c in (1, 2, 3))   # each elastic cell flipped
        assert prev[0] is cur[0] is Role.TRAIN                 # the core never flips
    to_train = sum(1 for p, c in zip(history, history[1:]) for i in (1, 2, 3) if c[i] is Role.TRAIN and p[i] is not c[i])
    to_rollout = sum(1 for p, c in zip(history, history[1:]) for i in (1, 2, 3) if c[i] is Role.ROLLOUT and p[i] is not c[i])
    assert to_train >= 6 and to_rollout >= 6


def test_rollout_only_and_switching_cells_are_left_alone():
    kinds = [CellKind.CORE, CellKind.ROLLOUT_ONLY, CellKind.ELASTIC]
    s = state(1, [Role.TRAIN, Role.ROLLOUT, Role.TRAIN], kinds=kinds, switching={2})
    assert scripted_policy(s) == []
    s = state(2, [Role.TRAIN, Role.ROLLOUT, Role.ROLLOUT], kinds=kinds)
    assert [(c.cell, c.to) for c in scripted_policy(s)] == [(2, wanted_role(2, 2))] == [(2, Role.TRAIN)]


def test_registry_name_scripted_gives_this_policy():
    assert get_policy("scripted") is scripted_policy

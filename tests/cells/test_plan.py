"""Cell plan, rank mapping and role rules: pure logic, no processes."""
import pytest

from gyre_hpc.cells.plan import (CONTROLLER_RANK, cell_of_rank, cell_ranks, core_cell, plan_cells, train_ranks,
                                 with_roles, world_size)
from gyre_hpc.config import CellPlan
from gyre_hpc.sched.state import CellKind, Role


def test_world_layout_is_controller_then_cells_in_order():
    plan = CellPlan(count=3, ranks_per_cell=2, core=1)
    assert world_size(plan) == 7
    assert [cell_ranks(plan, c) for c in range(3)] == [(1, 2), (3, 4), (5, 6)]
    cells = plan_cells(plan)
    assert cell_of_rank(cells, CONTROLLER_RANK) is None
    assert cell_of_rank(cells, 4).id == 1 and cell_of_rank(cells, 5).id == 2
    assert [c.leader for c in cells] == [1, 3, 5]


def test_kinds_and_initial_roles():
    plan = CellPlan(count=4, core=2, rollout_only=[3], initial_train=[0, 3])
    cells = plan_cells(plan)
    assert [c.kind for c in cells] == [CellKind.ELASTIC, CellKind.ELASTIC, CellKind.CORE, CellKind.ROLLOUT_ONLY]
    # initial_train can not make a rollout-only cell train.
    assert [c.role for c in cells] == [Role.TRAIN, Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT]
    assert core_cell(cells).id == 2


def test_roles_from_a_checkpoint_override_the_initial_split():
    cells = plan_cells(CellPlan(count=3), {1: Role.TRAIN})
    assert [c.role for c in cells] == [Role.TRAIN, Role.TRAIN, Role.ROLLOUT]


def test_forbidden_flips_name_the_cell():
    cells = plan_cells(CellPlan(count=3, core=0, rollout_only=[2]))
    with pytest.raises(ValueError, match="cell 0: the core cell always trains"):
        with_roles(cells, {0: Role.ROLLOUT})
    with pytest.raises(ValueError, match="cell 2: it is rollout-only"):
        with_roles(cells, {2: Role.TRAIN})
    with pytest.raises(ValueError, match=r"cell 7: no such cell; cells are \[0, 1, 2\]"):
        with_roles(cells, {7: Role.TRAIN})
    assert with_roles(cells, {1: "TRAIN"})[1].role is Role.TRAIN


def test_train_ranks_put_the_core_leader_first():
    plan = CellPlan(count=3, ranks_per_cell=2, core=2)
    cells = with_roles(plan_cells(plan), {0: Role.TRAIN})
    assert train_ranks(cells) == [5, 6, 1, 2]
    assert train_ranks(plan_cells(plan)) == [5, 6]

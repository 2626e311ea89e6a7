"""Cell plans from an allocation: the contract's rank layout, and impossible plans named."""
from __future__ import annotations

import pytest

from gyre_hpc.config import ConfigError, build_config
from gyre_hpc.jobs import plan as fleet_plan


def _het_env(tasks: list[int], nodes: list[str]) -> dict[str, str]:
    env = {"SLURM_HET_SIZE": str(len(tasks))}
    for g, (t, n) in enumerate(zip(tasks, nodes)):
        env[f"SLURM_NTASKS_HET_GROUP_{g}"] = str(t)
        env[f"SLURM_JOB_NODELIST_HET_GROUP_{g}"] = n
    return env


def test_local_plan_follows_the_rank_layout_of_the_contract():
    cfg = build_config({"cells": {"count": 3, "ranks_per_cell": 2}})
    plan = fleet_plan.local_plan(cfg)
    assert plan.world_size == 7
    assert plan.ranks_of("controller") == range(0, 1)
    assert [plan.ranks_of(f"cell{c}") for c in range(3)] == [range(1, 3), range(3, 5), range(5, 7)]
    assert plan.het_groups is None
    with pytest.raises(KeyError, match="no component 'cell9'"):
        plan.ranks_of("cell9")


def test_plan_for_nodes_gives_the_controller_a_spare_node():
    cfg = build_config({"cells": {"count": 3}})
    plan = fleet_plan.plan_for_nodes(cfg, ["c1", "c2", "c3", "c4"])
    assert [c.nodes for c in plan.components] == [("c1",), ("c2",), ("c3",), ("c4",)]


def test_plan_for_nodes_shares_the_first_cell_node_without_a_spare():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 2, "nodes_per_cell": 2}})
    plan = fleet_plan.plan_for_nodes(cfg, ["n1", "n2", "n3", "n4"])
    assert [c.nodes for c in plan.components] == [("n1",), ("n1", "n2"), ("n3", "n4")]


def test_too_few_nodes_names_the_fields():
    cfg = build_config({"cells": {"count": 4, "ranks_per_cell": 2, "nodes_per_cell": 2}})
    with pytest.raises(ConfigError, match=r"cells.count=4 x cells.nodes_per_cell=2 needs 8 nodes, the cluster has 3"):
        fleet_plan.plan_for_nodes(cfg, ["a", "b", "c"])


def test_het_job_plan_maps_group_0_to_the_controller_and_one_group_per_cell():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 2}})
    env = _het_env([1, 2, 2], ["c1", "c[2-3]", "c4"])
    plan = fleet_plan.plan_for_het_job(cfg, env, expand=lambda s: {"c[2-3]": ["c2", "c3"]}.get(s, [s]))
    assert plan.het_groups == (0, 1, 2)
    assert [c.name for c in plan.components] == ["controller", "cell0", "cell1"]
    assert plan.components[1].nodes == ("c2", "c3")
    assert plan.world_size == 5


def test_het_job_with_the_wrong_number_of_components_says_how_to_fix_it():
    cfg = build_config({"cells": {"count": 3}})
    with pytest.raises(ConfigError, match=r"the het job has 3 components, cells.count=3 needs 4.*submit --sbatch"):
        fleet_plan.plan_for_het_job(cfg, _het_env([1, 1, 1], ["c1", "c2", "c3"]))


def test_het_job_with_the_wrong_task_count_names_the_cell():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 2}})
    with pytest.raises(ConfigError, match=r"het group 2 has 1 tasks, cell 1 \(cells.ranks_per_cell\) needs 2"):
        fleet_plan.plan_for_het_job(cfg, _het_env([1, 2, 1], ["c1", "c2", "c3"]))


def test_het_job_shape_is_head_then_one_component_per_cell():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 3, "cpus_per_rank": 2, "nodes_per_cell": 1},
                        "slurm": {"head_cpus": 2}})
    assert fleet_plan.het_job_shape(cfg) == [(1, 1, 2), (1, 3, 2), (1, 3, 2)]


def test_a_cell_with_fewer_ranks_than_nodes_is_refused_by_name():
    # srun would drop the extra nodes with a warning ("can't run 1 processes on 2 nodes").
    with pytest.raises(ConfigError, match=r"cells.ranks_per_cell=1 < cells.nodes_per_cell=2: 1 node\(s\) of every "
                                          r"cell would hold no rank"):
        build_config({"cells": {"count": 2, "nodes_per_cell": 2}})


def test_slurms_cpus_per_node_reads_its_smallest_node():
    assert fleet_plan.cpus_per_node("4(x3),2") == 2
    assert fleet_plan.cpus_per_node("8") == 8
    assert fleet_plan.cpus_per_node(None) is None
    with pytest.raises(ConfigError, match="SLURM_JOB_CPUS_PER_NODE='four'"):
        fleet_plan.cpus_per_node("four")


def test_ranks_the_nodes_cannot_hold_are_refused_naming_the_fields():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 3, "nodes_per_cell": 2, "cpus_per_rank": 2}})
    fleet_plan.check_ranks_fit_nodes(cfg, 4)      # 2 ranks x 2 CPUs on the fuller node
    with pytest.raises(ConfigError, match=r"cells.ranks_per_cell=3 over cells.nodes_per_cell=2 puts 2 rank\(s\) x "
                                          r"cells.cpus_per_rank=2 = 4 CPUs on a node, the allocation's nodes have 3"):
        fleet_plan.plan_for_nodes(cfg, ["a", "b", "c", "d", "e"], node_cpus=3)


def test_the_head_checks_ranks_against_the_allocations_cpus():
    from gyre_hpc.jobs.head import plan_for_environment

    cfg = build_config({"cells": {"count": 1, "ranks_per_cell": 4}, "launcher": "slurm"})
    env = {"SLURM_JOB_NODELIST": "c1,c2"}
    assert plan_for_environment(cfg, env | {"SLURM_JOB_CPUS_PER_NODE": "4(x2)"}, expand=lambda s: s.split(",")).world_size == 5
    with pytest.raises(ConfigError, match="the allocation's nodes have 2"):
        plan_for_environment(cfg, env | {"SLURM_JOB_CPUS_PER_NODE": "2(x2)"}, expand=lambda s: s.split(","))

"""Where the head runs decides the plan; signals and batch-step detection."""
from __future__ import annotations

import pytest

from gyre_hpc.config import ConfigError, build_config
from gyre_hpc.jobs.head import in_batch_step, main, plan_for_environment

HET_ENV = {"SLURM_JOB_ID": "7", "SLURM_HET_SIZE": "3", "SLURM_JOB_NODELIST": "c1",
           "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "1", "SLURM_NTASKS_HET_GROUP_2": "1",
           "SLURM_JOB_NODELIST_HET_GROUP_0": "c1", "SLURM_JOB_NODELIST_HET_GROUP_1": "c2",
           "SLURM_JOB_NODELIST_HET_GROUP_2": "c3"}


def _expand(s):
    return {"c[1-4]": ["c1", "c2", "c3", "c4"]}.get(s, [s])


def test_local_launcher_ignores_the_allocation():
    cfg = build_config({"cells": {"count": 2}})
    plan = plan_for_environment(cfg, HET_ENV, expand=_expand)
    assert plan.het_groups is None and all(c.nodes == () for c in plan.components)


def test_slurm_in_a_het_job_uses_its_groups():
    cfg = build_config({"cells": {"count": 2}, "launcher": "slurm"})
    plan = plan_for_environment(cfg, HET_ENV, expand=_expand)
    assert plan.het_groups == (0, 1, 2)
    assert [c.nodes for c in plan.components] == [("c1",), ("c2",), ("c3",)]


def test_slurm_in_a_plain_allocation_is_a_het_step_over_its_nodes():
    cfg = build_config({"cells": {"count": 3}, "launcher": "slurm"})
    plan = plan_for_environment(cfg, {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "c[1-4]"}, expand=_expand)
    assert plan.het_groups is None
    assert [c.nodes for c in plan.components] == [("c1",), ("c2",), ("c3",), ("c4",)]


def test_slurm_without_an_allocation_lets_srun_place_components():
    cfg = build_config({"cells": {"count": 2, "ranks_per_cell": 2, "nodes_per_cell": 2}, "launcher": "slurm"})
    plan = plan_for_environment(cfg, {}, expand=_expand)
    assert [(c.nodes, c.nnodes) for c in plan.components] == [((), 1), ((), 2), ((), 2)]


def test_only_the_batch_step_may_requeue():
    assert in_batch_step({"SLURM_JOB_ID": "3"})
    assert not in_batch_step({"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0"})
    assert not in_batch_step({})


def test_head_reports_a_bad_config_by_field_and_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cells:\n  count: 2\n  cores: 1\n")
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cells.cores: unknown key; valid keys here:" in err and "count" in err


def test_too_few_nodes_for_the_cells_fails_before_launch():
    cfg = build_config({"cells": {"count": 5}, "launcher": "slurm"})
    with pytest.raises(ConfigError, match="needs 5 nodes, the cluster has 4"):
        plan_for_environment(cfg, {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "c[1-4]"}, expand=_expand)


@pytest.mark.parametrize("override,named", [
    ("rollout.tasks=nope", "rollout.tasks='nope' is not a task suite; valid suites: builtin, easy"),
    ("model.preset=huge", "model.preset='huge' is unknown; valid presets: small, tiny"),
    ("scheduler.elastic={fil: 0.5}", "scheduler.elastic: policy 'elastic' has no parameter fil; valid parameters:"),
])
def test_unknown_suite_preset_or_scheduler_key_is_refused_before_any_launch(tmp_path, capsys, override, named):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"workload: rl\nrun_dir: {tmp_path / 'run'}\ncells:\n  count: 1\n")
    rc = main([str(cfg), "--set", override])
    out = capsys.readouterr()
    assert rc == 2
    assert named in out.out + out.err
    assert not (tmp_path / "run" / "logs").exists()    # no fleet was launched

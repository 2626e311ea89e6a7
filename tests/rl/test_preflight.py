"""The rl preflight: a run's model checkpoint and task directory checked and made absolute before anything
launches."""
from __future__ import annotations

import pytest

from gyre_hpc.config import ConfigError, build_config
from gyre_hpc.harness.tasks import load_suite, write_task_dir
from gyre_hpc.models.checkpoint import save_pretrained
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.rl.preflight import absolute_task_dirs, check_config, prepare_config
from gyre_hpc.rl.tasks import load_tasks


def _cfg(tmp_path, path: str):
    return build_config({"workload": "rl", "run_dir": str(tmp_path / "run"), "model": {"path": path},
                         "rollout": {"allow_unconfined": True}})


def test_a_relative_model_path_is_the_one_where_the_run_was_started(tmp_path, monkeypatch):
    save_pretrained(build_model("tiny", seed=0), tmp_path / "ckpt")
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, "ckpt")
    check_config(cfg)
    # The fleet's ranks start in the run directory: they get the path from here, absolute.
    assert prepare_config(cfg, build=False).model.path == str(tmp_path / "ckpt")
    assert prepare_config(_cfg(tmp_path, str(tmp_path / "ckpt")), build=False).model.path == str(tmp_path / "ckpt")


def test_a_model_path_that_is_no_checkpoint_is_refused_by_name(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"model.path='.*empty' holds no config.json"):
        check_config(_cfg(tmp_path, str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match=r"model.path='.*missing' is not a checkpoint directory"):
        check_config(_cfg(tmp_path, str(tmp_path / "missing")))


def _tasks_cfg(tmp_path, tasks: str):
    return build_config({"workload": "rl", "run_dir": str(tmp_path / "run"),
                         "rollout": {"allow_unconfined": True, "tasks": tasks}})


def test_a_task_directory_is_read_before_launch_and_its_relative_path_made_absolute(tmp_path, monkeypatch):
    write_task_dir(load_suite("repo"), tmp_path / "mine")
    monkeypatch.chdir(tmp_path)
    cfg = _tasks_cfg(tmp_path, "./mine")
    check_config(cfg)
    assert load_tasks("./mine") == load_suite("repo")
    # The fleet's ranks start in the run directory: they get the directory from here, absolute.
    assert prepare_config(cfg, build=False).rollout.tasks == str(tmp_path / "mine")
    assert absolute_task_dirs(_tasks_cfg(tmp_path, "easy-tool")).rollout.tasks == "easy-tool"   # a suite stays
    assert absolute_task_dirs(_tasks_cfg(tmp_path, "long")).rollout.tasks == "long"


def test_a_broken_or_missing_task_directory_is_refused_before_launch(tmp_path):
    write_task_dir(load_suite("repo"), tmp_path / "mine")
    (tmp_path / "mine" / "fizzbuzz" / "task.yaml").write_text("prompt: x\nturn_budget: -1\n")
    with pytest.raises(ConfigError, match=r"mine/fizzbuzz/task.yaml: turn_budget: Input should be greater than"):
        check_config(_tasks_cfg(tmp_path, str(tmp_path / "mine")))
    with pytest.raises(ConfigError, match=r"rollout.tasks='.*/gone': no such directory"):
        check_config(_tasks_cfg(tmp_path, str(tmp_path / "gone")))
    with pytest.raises(ConfigError, match=r"rollout.tasks='nope' is not a task suite; valid suites: builtin, easy, "
                                          r"easy-3turn, easy-tool.*or a directory of tasks"):
        check_config(_tasks_cfg(tmp_path, "nope"))


def test_more_ranks_per_cell_than_a_tensors_rows_is_refused_before_launch(tmp_path):
    """Checked on the model's shapes (a meta-device model): the preset's narrowest tensor is
    its single kv head's projection, 32 rows."""
    def cfg(ranks, **model):
        return build_config({"workload": "rl", "run_dir": str(tmp_path / "run"), "model": model,
                             "cells": {"ranks_per_cell": ranks}, "rollout": {"allow_unconfined": True}})

    with pytest.raises(ConfigError, match=r"cells.ranks_per_cell=32: the rl workload runs one rank per cell"):
        check_config(cfg(32, preset="tiny"))     # shardable; the rl step is not sharded yet
    with pytest.raises(ConfigError, match=r"cells.ranks_per_cell=33: the model's model.layers.0.self_attn.k_proj.bias "
                                          r"has 32 rows .* at most 32 ranks per cell"):
        check_config(cfg(33, preset="tiny"))
    from gyre_hpc.models.decoder import LMConfig

    save_pretrained(build_model(LMConfig(vocab_size=512, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=24)),
                    tmp_path / "narrow")
    with pytest.raises(ConfigError, match=r"cells.ranks_per_cell=16: the model's .*k_proj.* has 8 rows"):
        check_config(cfg(16, path=str(tmp_path / "narrow")))

"""The rl preflight: a run's model checkpoint checked and made absolute before anything launches."""
from __future__ import annotations

import pytest

from gyre_hpc.config import ConfigError, build_config
from gyre_hpc.models.checkpoint import save_pretrained
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.rl.preflight import check_config, prepare_config


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

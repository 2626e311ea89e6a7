"""The warm start: teacher trajectories through the real loop, SFT on their trees, the cached checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre_hpc.config import ConfigError, build_config, load_config
from gyre_hpc.harness.tasks import load_suite, write_task_dir
from gyre_hpc.models.checkpoint import load_pretrained
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.warmstart.cache import (SHIPPED, cached_warmstart, ensure_warmstart, ship_warmstart, teacher_harness,
                                     warmstart_key, warmstart_source, with_warmstart)
from gyre_hpc.warmstart.sft import train_sft
from gyre_hpc.warmstart.trajectories import teacher_runs

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _cfg(tmp_path, *extra):
    return build_config({"workload": "rl", "rollout": {"tasks": "long", "max_new_tokens": 176, "context_limit": 768,
                                                       "subagent_turns": 6, "tool_output_bytes": 192}},
                        [f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.runs_per_task=1", "warmstart.steps=3",
                         "warmstart.enabled=true", *extra])


def test_teacher_trees_train_every_teacher_output_and_sft_lowers_the_loss(tmp_path):
    cfg = _cfg(tmp_path)
    runs = teacher_runs(load_suite("long")[:1], 1, teacher_harness(cfg))
    (result,), (tree,) = runs.results, runs.trees
    assert result.reward == 1.0 and runs.stats()["with_retry"] == 1
    assert int(tree.trained.sum()) == sum(c.output.size for c in result.calls)
    torch.set_num_threads(1)     # shared cores: more threads only slow each step
    model = build_model("tiny", seed=0)
    report = train_sft(model, runs.trees, steps=20, lr=1e-2, row_tokens=2048, max_s=300)
    assert report.steps == 20 and report.stopped_by == "steps"
    assert report.loss_last < 0.8 * report.loss_first


def test_warmstart_key_follows_suite_preset_and_settings(tmp_path):
    base = warmstart_key(_cfg(tmp_path))
    assert base == warmstart_key(_cfg(tmp_path, "rollout.run_timeout_s=7"))   # the wall clock does not shape it
    assert base != warmstart_key(_cfg(tmp_path, "model.preset=small"))
    assert base != warmstart_key(_cfg(tmp_path, "rollout.context_limit=1024"))
    assert base != warmstart_key(_cfg(tmp_path, "warmstart.lr=0.5"))
    assert base != warmstart_key(_cfg(tmp_path, "warmstart.seed=1"))
    assert base == warmstart_key(_cfg(tmp_path, "seed=3"))      # RL seeds share one warm start


def test_warmstart_refuses_a_suite_the_teacher_does_not_know(tmp_path):
    with pytest.raises(ValueError, match="rollout.tasks='easy' has tasks without a teacher playbook .*"
                                         "suites with playbooks: long, xlong, xlong-large, xlong-mini$"):
        warmstart_key(_cfg(tmp_path, "rollout.tasks=easy"))
    with pytest.raises(ValueError, match="warmstart.tasks='easy' has tasks without a teacher playbook"):
        warmstart_key(_cfg(tmp_path, "warmstart.tasks=easy"))
    with pytest.raises(ValueError, match="warmstart.tasks='nope' is not a task suite; valid suites: builtin"):
        warmstart_key(_cfg(tmp_path, "warmstart.tasks=nope"))


def test_a_built_in_suite_written_as_files_keeps_its_warmstart_key_and_an_edited_one_is_refused(tmp_path):
    write_task_dir(load_suite("long"), tmp_path / "long")
    # The key hashes the tasks' contents: the same suite from files is the same warm start.
    assert warmstart_key(_cfg(tmp_path, f"rollout.tasks={tmp_path / 'long'}")) == warmstart_key(_cfg(tmp_path))
    spec = tmp_path / "long" / "lh-greet" / "task.yaml"
    spec.write_text(spec.read_text().replace("turn_budget: 16", "turn_budget: 15"))
    # Same id, other task: the lh-greet playbook was written for the built-in one.
    with pytest.raises(ValueError, match=r"warmstart.tasks='.*/long' has tasks without a teacher playbook "
                                         r"\(lh-greet\); a playbook is written for a built-in task"):
        warmstart_key(_cfg(tmp_path, f"warmstart.tasks={tmp_path / 'long'}"))
    with pytest.raises(ValueError, match=r"rollout.tasks='.*/examples/tasks' has tasks without a teacher playbook "
                                         r"\(add-two, word-count\)"):
        warmstart_key(_cfg(tmp_path, f"rollout.tasks={EXAMPLES / 'tasks'}"))


def test_warmstart_tasks_picks_the_suite_the_teacher_runs_and_rl_may_run_larger_ones(tmp_path):
    base = warmstart_key(_cfg(tmp_path))                                      # the teacher runs rollout.tasks
    assert base == warmstart_key(_cfg(tmp_path, "warmstart.tasks=long"))      # naming it keeps the key
    assert base == warmstart_key(_cfg(tmp_path, "rollout.tasks=xlong-large", "warmstart.tasks=long"))
    assert base != warmstart_key(_cfg(tmp_path, "warmstart.tasks=xlong-mini"))
    # examples/xlong.yaml: warm start on xlong, RL on xlong-large, under the key that ships.
    xlong = load_config(str(EXAMPLES / "xlong.yaml"))
    assert (xlong.rollout.tasks, xlong.warmstart.tasks) == ("xlong-large", "xlong")
    assert warmstart_key(xlong) == warmstart_key(load_config(str(EXAMPLES / "xlong.yaml"),
                                                             ["rollout.tasks=xlong", "warmstart.tasks=null"]))


@pytest.mark.slow
def test_warmstart_builds_once_and_points_the_run_at_its_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    assert cached_warmstart(cfg) is None
    with pytest.raises(ConfigError, match="warmstart.enabled: no cached warm-start checkpoint"):
        with_warmstart(cfg, build=False)                     # a login node builds nothing
    path = ensure_warmstart(cfg, log=lambda m: None)
    assert with_warmstart(cfg, build=False).model.path == str(path.resolve())
    assert cached_warmstart(cfg) == path
    report = json.loads((path / "warmstart.json").read_text())
    assert report["key"] == path.name and report["sft"]["steps"] == 3 and report["teacher"]["reward_mean"] == 1.0
    model = load_pretrained(path)
    assert model.config.vocab_size == build_model("tiny").config.vocab_size
    weights = (path / "model.safetensors").stat().st_mtime_ns
    logs = []
    started = with_warmstart(cfg, log=logs.append)
    assert started.model.path == str(path.resolve()) and "cached" in logs[0]
    assert (path / "model.safetensors").stat().st_mtime_ns == weights
    assert with_warmstart(started).model.path == started.model.path          # an explicit path wins
    assert with_warmstart(_cfg(tmp_path, "warmstart.enabled=false")).model.path is None
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]   # no scratch left behind
    assert np.isfinite(report["sft"]["loss_last"])


def test_teacher_give_up_is_an_even_share_of_every_task_runs():
    from gyre_hpc.warmstart.trajectories import gives_up

    assert [gives_up(g, 0.5) for g in range(4)] == [0.0, 1.0, 0.0, 1.0]
    assert [gives_up(g, 0.0) for g in range(4)] == [0.0] * 4
    assert [gives_up(g, 1.0) for g in range(3)] == [1.0] * 3
    assert sum(gives_up(g, 0.25) for g in range(8)) == 2


def test_teacher_wrong_rate_reaches_the_xlong_teacher_and_the_cache_key(tmp_path):
    """A wrong first write is reported and rewritten: the warm start's data holds the recovery."""
    xcfg = build_config({"workload": "rl", "rollout": {"tasks": "xlong-mini", "max_new_tokens": 64,
                                                        "context_limit": 4096, "subagent_turns": 80,
                                                        "max_delegations": 12, "max_retries": 6,
                                                        "tool_output_bytes": 192, "run_timeout_s": 600}},
                        [f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.enabled=true"])
    task = load_suite("xlong-mini")[:1]
    plain, wrong = (teacher_runs(task, 1, teacher_harness(xcfg), wrong_rate=w) for w in (0.0, 1.0))
    (p,), (w,) = plain.results, wrong.results
    assert p.reward == w.reward == 1.0
    assert len(w.calls) > len(p.calls)
    assert warmstart_key(xcfg) != warmstart_key(build_config(xcfg.model_dump(), ["warmstart.teacher_wrong_rate=0.1"]))


def _example_keys() -> dict[str, str]:
    keys = {}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        cfg = load_config(str(path), [])
        if cfg.workload == "rl" and cfg.warmstart.enabled:
            keys[warmstart_key(cfg)] = path.name
    return keys


def test_every_shipped_warmstart_is_an_example_configs_current_key():
    shipped = sorted(p.name for p in SHIPPED.iterdir() if not p.name.startswith("."))
    keys = _example_keys()
    stale = [k for k in shipped if k not in keys]
    assert not stale, (f"shipped warm starts {stale} match no example config's key: rebuild and ship with "
                       f"`gyre-hpc warmstart examples/xlong.yaml --ship`, then delete the stale directory")
    assert "xlong.yaml" in [keys[k] for k in shipped]         # the one whose build outruns its bench


def test_a_cache_without_the_key_installs_the_shipped_checkpoint_and_trains_nothing(tmp_path):
    xlong = str(EXAMPLES / "xlong.yaml")
    cfg = load_config(xlong, [f"warmstart.cache_dir={tmp_path / 'ws'}"])
    key = warmstart_key(cfg)
    assert warmstart_source(cfg) == "shipped"
    logs = []
    started = with_warmstart(cfg, log=logs.append, build=False)      # a login node: copies, trains nothing
    path = tmp_path / "ws" / key
    assert started.model.path == str(path.resolve()) and "shipped" in logs[0]
    for f in (SHIPPED / key).iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes()
    assert warmstart_source(cfg) == "cache"
    assert json.loads((path / "warmstart.json").read_text())["key"] == key
    assert load_pretrained(path).config.vocab_size == build_model("tiny").config.vocab_size
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]   # no scratch left behind
    other = load_config(xlong, [f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=17"])
    assert warmstart_source(other) == "build"                          # another key: nothing shipped


def test_ship_copies_a_checkpoint_under_its_key_and_replaces_an_older_copy(tmp_path):
    key = next(p.name for p in SHIPPED.iterdir() if not p.name.startswith("."))
    built = tmp_path / "cache" / key
    built.parent.mkdir()
    shutil.copytree(SHIPPED / key, built)
    package = tmp_path / "shipped"
    assert ship_warmstart(built, into=package) == package / key
    (built / "warmstart.json").write_text('{"key": "%s", "rebuilt": true}' % key)
    ship_warmstart(built, into=package)                      # a rebuild replaces the shipped copy
    assert json.loads((package / key / "warmstart.json").read_text())["rebuilt"] is True
    assert (package / key / "model.safetensors").read_bytes() == (SHIPPED / key / "model.safetensors").read_bytes()
    assert sorted(p.name for p in package.iterdir()) == [key]   # no scratch or aside left

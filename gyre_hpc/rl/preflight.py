"""Checks of an rl run's config against the registries it names, run by the head before launch.

Why here and not in ``config.py``: the task suites and model presets live in packages the
bottom-layer config may not import; without this an unknown name passed validation and
failed inside the fleet after four launches, the error only in the fleet log.
"""
from __future__ import annotations

from pathlib import Path

from gyre_hpc.config import ConfigError, RunConfig


def check_config(cfg: RunConfig) -> None:
    """Raise ConfigError naming the field and the valid choices; returns quietly when fine."""
    from gyre_hpc.rl.tasks import task_suite_names

    suites = task_suite_names()
    if cfg.rollout.tasks not in suites:
        raise ConfigError(f"rollout.tasks={cfg.rollout.tasks!r} is not a task suite; valid suites: {', '.join(suites)}")
    if cfg.model.path:
        if not Path(cfg.model.path).is_dir():
            raise ConfigError(f"model.path={cfg.model.path!r} is not a checkpoint directory")
        return
    from gyre_hpc.models.tiny_lm import PRESETS

    if cfg.model.preset not in PRESETS:
        raise ConfigError(f"model.preset={cfg.model.preset!r} is unknown; valid presets: {', '.join(sorted(PRESETS))}")


def prepare_config(cfg: RunConfig, build: bool, log=print) -> RunConfig:
    """``cfg`` starting from its warm-start checkpoint (``warmstart.cache.with_warmstart``)."""
    from gyre_hpc.warmstart.cache import with_warmstart

    return with_warmstart(cfg, log=log, build=build)

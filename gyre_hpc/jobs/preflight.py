"""The head's check of a config before any rank starts, by workload.

Each workload's check lives with the workload (``rl.preflight``: task suites, model presets)
and is named here, not imported at module level, as ``supervisor.FLEET_MODULES`` names the
fleet modules: ``jobs`` sits below the workloads, so the head reaches a workload only through
these entry points and only for the workload the config asks for.
"""
from __future__ import annotations

import importlib

from gyre_hpc.config import RunConfig

# workload -> "module:function" raising ConfigError naming the field; a workload without an
# entry has nothing to check beyond config.py's own validation.
WORKLOAD_CHECKS = {"rl": "gyre_hpc.rl.preflight:check_config"}
# workload -> "module:function" (cfg, build, log) -> cfg: what the workload resolves before
# launch (rl: the warm-start checkpoint, built here when ``build``, else only looked up).
WORKLOAD_PREPARES = {"rl": "gyre_hpc.rl.preflight:prepare_config"}


def _workload_entry(table: dict[str, str], cfg: RunConfig):
    """The function ``table`` names for this config's workload, or None."""
    entry = table.get(cfg.workload)
    if entry is None:
        return None
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


def check_workload_config(cfg: RunConfig) -> None:
    """ConfigError naming the field when the workload cannot run this config."""
    check = _workload_entry(WORKLOAD_CHECKS, cfg)
    if check is not None:
        check(cfg)


def prepare_workload_config(cfg: RunConfig, build: bool, log=print) -> RunConfig:
    """The config the fleet runs: ``cfg`` with what its workload resolves before launch.

    ``build=False`` on a login node (``submit``): nothing is trained there, a missing artefact
    is a ConfigError naming what to build."""
    prepare = _workload_entry(WORKLOAD_PREPARES, cfg)
    return cfg if prepare is None else prepare(cfg, build, log)

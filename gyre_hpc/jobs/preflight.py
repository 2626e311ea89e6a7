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


def check_workload_config(cfg: RunConfig) -> None:
    """ConfigError naming the field when the workload cannot run this config."""
    entry = WORKLOAD_CHECKS.get(cfg.workload)
    if entry is None:
        return
    module, name = entry.split(":")
    getattr(importlib.import_module(module), name)(cfg)

"""The fleet's check of a config before any rank starts, by workload (as ``__main__`` dispatches)."""
from __future__ import annotations

from gyre_hpc.config import RunConfig


def check_workload_config(cfg: RunConfig) -> None:
    """ConfigError naming the field when the workload cannot run this config."""
    if cfg.workload == "rl":
        from gyre_hpc.rl.preflight import check_config

        check_config(cfg)

"""The substrate workload as the fleet runs it (``python -m gyre_hpc.substrate --run-dir D``).

A peer of ``gyre_hpc.rl``: the fleet (``cells.fleet.run_fleet``) is the same; this says what
the substrate puts on top: ``SubstrateWorkload`` as each rank's state, its rounds' handler on
the cell ranks, ``SubstrateDriver`` on rank 0.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

from gyre_hpc.cells.controller import Controller, StepDriver
from gyre_hpc.cells.fleet import FleetOptions, FleetStart, FleetWorkload
from gyre_hpc.config import ConfigError, RunConfig
from gyre_hpc.substrate.driver import SubstrateDriver
from gyre_hpc.substrate.rank import SubstrateRankHandler
from gyre_hpc.substrate.workload import SubstrateWorkload


def _rank_workload(cfg: RunConfig, rank: int) -> SubstrateWorkload:
    return SubstrateWorkload(cfg)


def _step_driver(ctl: Controller, fs: FleetStart, stack: contextlib.ExitStack) -> StepDriver:
    return SubstrateDriver(ctl)


def check_substrate_config(cfg: RunConfig) -> None:
    if cfg.workload != "substrate":
        raise ConfigError(f"workload={cfg.workload!r}: `python -m gyre_hpc.substrate` runs the substrate workload; "
                          f"start the {cfg.workload} fleet with `python -m gyre_hpc.{cfg.workload}`")


SUBSTRATE = FleetWorkload(name="substrate", rank_workload=_rank_workload, step_driver=_step_driver,
                          rank_handler=lambda fs, cell_rank: SubstrateRankHandler(cell_rank.workload),
                          check=check_substrate_config)


def substrate_options(**fields) -> FleetOptions:
    """The fleet's options for the substrate (``fields``: any other ``FleetOptions`` field)."""
    return replace(FleetOptions(workload=SUBSTRATE), **fields)

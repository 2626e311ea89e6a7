"""``python -m gyre_hpc.cells --run-dir RUN_DIR``: one fleet rank (the launchers start them all).

Exit codes: 0 all ``train.steps`` done; 75 checkpointed and stopped on
``control/checkpoint-and-exit``; anything else a failure the supervisor relaunches from.
"""
from __future__ import annotations

import argparse
import sys

from gyre_hpc.cells.rank_env import prepare_rank_env

# Before mpi4py and torch are imported: both read these once, at start (see rank_env).
prepare_rank_env()

from gyre_hpc.cells.fleet import exit_rank, main_guarded  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_hpc.cells", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    args = parser.parse_args(argv)
    if _workload(args.run_dir) == "rl":
        from gyre_hpc.rl.fleet import main_guarded as rl_main_guarded
        return exit_rank(rl_main_guarded(args.run_dir))
    return exit_rank(main_guarded(args.run_dir))


def _workload(run_dir: str) -> str:
    """``workload`` of the run's config (``substrate`` | ``rl``); a bad config fails later, by name."""
    from gyre_hpc.config import ConfigError, load_config
    from gyre_hpc.rundir.layout import RunDir

    try:
        return load_config(RunDir.at(run_dir).config).workload
    except ConfigError:
        return "substrate"


if __name__ == "__main__":
    sys.exit(main())

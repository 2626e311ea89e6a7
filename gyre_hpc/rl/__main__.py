"""``python -m gyre_hpc.rl --run-dir RUN_DIR``: one rank of an rl fleet (the launchers start
them all when the run's config says ``workload: rl``).

Exit codes as ``python -m gyre_hpc.cells``: 0 all ``train.steps`` done; 75 checkpointed and
stopped on ``control/checkpoint-and-exit``; anything else a failure the supervisor relaunches from.
"""
from __future__ import annotations

import argparse
import sys

from gyre_hpc.cells.rank_env import prepare_rank_env

# Before mpi4py and torch are imported: both read these once, at start (see rank_env).
prepare_rank_env()

from gyre_hpc.cells.fleet import exit_rank  # noqa: E402
from gyre_hpc.rl.fleet import main_guarded  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_hpc.rl", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    args = parser.parse_args(argv)
    return exit_rank(main_guarded(args.run_dir))


if __name__ == "__main__":
    sys.exit(main())

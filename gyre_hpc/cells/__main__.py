"""``python -m gyre_hpc.cells --run-dir RUN_DIR``: one rank of a substrate fleet (the launchers
start them all; the rl workload's fleet is ``python -m gyre_hpc.rl``, same protocol).

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
    return exit_rank(main_guarded(args.run_dir))


if __name__ == "__main__":
    sys.exit(main())

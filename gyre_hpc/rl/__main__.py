"""``python -m gyre_hpc.rl --run-dir RUN_DIR``: one rank of an rl fleet (the launchers start
them all when the run's config says ``workload: rl``).

Exit codes as every fleet's (``cells.fleet``): 0 all ``train.steps`` done; 75 checkpointed and
stopped on ``control/checkpoint-and-exit``; anything else a failure the supervisor relaunches from.
"""
from __future__ import annotations

import sys

from gyre_hpc.cells.rank_env import prepare_rank_env

# Before mpi4py and torch are imported: both read these once, at start (see rank_env).
prepare_rank_env()

from gyre_hpc.cells.fleet import rank_main  # noqa: E402
from gyre_hpc.rl.fleet import rl_options  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return rank_main("python -m gyre_hpc.rl", __doc__, rl_options(), argv)


if __name__ == "__main__":
    sys.exit(main())

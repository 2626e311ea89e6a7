"""``python -m gyre_hpc.cells --run-dir RUN_DIR``: one fleet rank (the launchers start them all).

Exit codes: 0 all ``train.steps`` done; 75 checkpointed and stopped on
``control/checkpoint-and-exit``; anything else a failure the supervisor relaunches from.
"""
from __future__ import annotations

import argparse
import sys

from gyre_hpc.cells.fleet import main_guarded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_hpc.cells", description=__doc__)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    args = parser.parse_args(argv)
    return main_guarded(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())

"""A trivial MPI program for launcher conformance: each rank reports where it runs.

Usage: python mpi_probe.py OUT_DIR [--sleep S] [--exit-code N]   (N: rank 0's code; others exit 0)
Writes OUT_DIR/rank-<r>.json after a barrier (so every file proves the world formed).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from mpi4py import MPI


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--exit-code", type=int, default=0)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    total = world.allreduce(1)  # a real collective across every rank
    world.Barrier()
    info = {"rank": world.Get_rank(), "size": world.Get_size(), "allreduce": total,
            "host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME"),
            "step": os.environ.get("SLURM_STEP_ID"), "job": os.environ.get("SLURM_JOB_ID"),
            "omp_threads": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid(),
            "yield_when_idle": os.environ.get("OMPI_MCA_mpi_yield_when_idle"),
            "btl": os.environ.get("OMPI_MCA_btl")}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{info['rank']}.json").write_text(json.dumps(info))
    if args.sleep:
        (out / f"sleeping-{info['rank']}").touch()
        time.sleep(args.sleep)
    world.Barrier()
    if world.Get_rank() != 0:
        return 0
    if args.exit_code:
        # Last to leave: under `srun --kill-on-bad-exit` an early non-zero exit gets the other
        # ranks SIGTERMed in teardown and srun then reports 143 (the supervisor reconciles that
        # for the fleet); the launchers' own contract is that the world's code reaches the handle.
        time.sleep(1.0)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())

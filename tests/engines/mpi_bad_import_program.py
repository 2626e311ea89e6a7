"""Run under ``mpiexec -n 3``: engine 2 runs in float64, so a state from engine 1 (float32)
does not fit it. The drain must fail with an error naming the field, and nobody may hang.
Usage: mpi_bad_import_program.py MODEL_DIR OUT_JSON.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI

from gyre_hpc.engines import EngineError, Request, SamplingParams
from gyre_hpc.engines.mpi_engines import MPIEngines, serve_engine
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.engines.router import Router

from mpi_migration_program import HoldingEngine   # keeps "a" in flight until the drain


def main() -> None:
    torch.set_num_threads(1)
    model_dir, out_path = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    if rank == 0:
        transport = MPIEngines(comm, {1: 1, 2: 2})
        router = Router(transport, [1])        # route everything to engine 1 first
        router.submit(Request("a", (257, 1, 2, 3), SamplingParams(max_new_tokens=200, temperature=0.0,
                                                                  stop_token_ids=())))
        while not router.poll():
            pass
        router.add_engine(2)
        try:
            router.drain(1)
            error = None
        except EngineError as exc:
            error = str(exc)
        counters = transport.stop()
        json.dump({"error": error, "source_out": counters[1].migrations_out, "dest_in": counters[2].migrations_in},
                  open(out_path, "w"))
    else:
        dtype = torch.float64 if rank == 2 else None
        kind = HoldingEngine if rank == 1 else TorchEngine
        serve_engine(kind.from_pretrained(model_dir, dtype=dtype, name=f"rank{rank}"), comm, controller=0)
    comm.Barrier()


if __name__ == "__main__":
    from gyre_hpc.cells.fleet import guard_world   # imports MPI: under mpiexec only, never in pytest

    guard_world(main, Path(__file__).stem)   # one failed rank must not leave the others waiting

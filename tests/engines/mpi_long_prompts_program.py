"""Run under ``mpiexec -n 2``: rank 0 routes, rank 1 serves a TorchEngine; prompts of thousands of tokens.

The controller submits a burst of long prompts, each finishing after one token, so the engine
sends outputs that carry their prompts (past MPI's eager limit) while the controller is still
sending submits of the same size. With blocking sends on both sides the two ranks wait on each
other forever (what stalled every xlong run at its first 4K-token contexts).
Usage: mpi_long_prompts_program.py MODEL_DIR OUT_JSON N_REQUESTS PROMPT_TOKENS.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from gyre_hpc.engines import Request, SamplingParams
from gyre_hpc.engines.mpi_engines import MPIEngines, serve_engine
from gyre_hpc.engines.router import Router
from gyre_hpc.engines.torch_engine import TorchEngine


def long_prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple(3 + (i * 7 + k) % 250 for k in range(n))


def main() -> None:
    from mpi4py import MPI

    torch.set_num_threads(1)
    model_dir, out_path, n_requests, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    comm = MPI.COMM_WORLD.Dup()
    if comm.Get_rank() == 0:
        transport = MPIEngines(comm, {1: 1})
        router = Router(transport, [1])
        for i in range(n_requests):
            router.submit(Request(f"c{i}", long_prompt(i, n_tokens),
                                  SamplingParams(max_new_tokens=1, seed=i, stop_token_ids=())))
        outputs = router.run_until_done()
        json.dump({"finished": sorted(o.request_id for o in outputs),
                   "prompts_intact": all(o.prompt_ids == long_prompt(int(o.request_id[1:]), n_tokens) for o in outputs)},
                  open(out_path, "w"))
        transport.stop()
    else:
        serve_engine(TorchEngine.from_pretrained(model_dir, name="rank1"), comm, controller=0)
    comm.Barrier()


if __name__ == "__main__":
    from gyre_hpc.cells.fleet import guard_world   # imports MPI: under mpiexec only, never in pytest

    guard_world(main, Path(__file__).stem)   # one failed rank must not leave the others waiting

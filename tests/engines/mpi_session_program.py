"""Run under ``mpiexec -n 3``: rank 0 routes, ranks 1 and 2 each serve a TorchEngine.

A session's first call runs on engine 1 (both idle: the lower id), which keeps its context.
Engine 1 is drained while idle: nothing is in flight, but the retained context moves to
engine 2 over MPI (the chunked KV transfer). The session's second call then routes to
engine 2 and prefills only its new tokens. Finally ``forget`` drops the context there.
Usage: mpi_session_program.py MODEL_DIR OUT_JSON.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from gyre_hpc.engines import Request, SamplingParams
from gyre_hpc.engines.mpi_engines import MPIEngines, serve_engine
from gyre_hpc.engines.router import Router
from gyre_hpc.engines.torch_engine import TorchEngine

TOOL = tuple(b"\nresult: ok\n")


def params(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=16, temperature=1.0, seed=seed, stop_token_ids=())


def second_prompt(first, output_ids) -> tuple[int, ...]:
    return tuple(first) + tuple(output_ids) + TOOL


def controller(comm, first, out_path) -> None:
    transport = MPIEngines(comm, {1: 1, 2: 2})
    router = Router(transport, [1, 2])
    home = router.submit(Request("c0", tuple(first), params(1), session="r0/main"))
    out1 = router.run_until_done()[0]
    held_before = transport.stats(home)["sessions"]
    before = transport.stats(2)["counters"]
    result = router.drain(1)
    second = second_prompt(first, out1.token_ids)
    routed = router.submit(Request("c1", second, params(2), session="r0/main"))
    out2 = router.run_until_done()[0]
    after = transport.stats(2)["counters"]
    forgotten = router.forget(["r0/main"])
    deadline = time.monotonic() + 30
    while transport.stats(2)["sessions"] and time.monotonic() < deadline:
        time.sleep(0.01)   # forget has no reply; the stats command queues behind it anyway
    json.dump({
        "home": home, "held_before": held_before, "routed": routed, "moved": dict(result.moved),
        "moved_sessions": dict(result.moved_sessions), "session_kv_tokens": result.session_kv_tokens,
        "session_bytes": result.session_bytes, "source_after": transport.stats(1)["sessions"],
        "first_output": list(out1.token_ids), "second": list(second), "second_output": list(out2.token_ids),
        "second_logprobs": list(out2.logprobs), "before": dataclasses.asdict(before),
        "after": dataclasses.asdict(after), "forgotten": forgotten, "dest_after_forget": transport.stats(2)["sessions"],
    }, open(out_path, "w"))
    transport.stop()


def main() -> None:
    from mpi4py import MPI

    torch.set_num_threads(1)
    model_dir, out_path = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD.Dup()
    first = json.load(open(f"{model_dir}/session_prompt.json"))
    if comm.Get_rank() == 0:
        controller(comm, first, out_path)
    else:
        engine = TorchEngine.from_pretrained(model_dir, name=f"rank{comm.Get_rank()}")
        serve_engine(engine, comm, controller=0, chunk_bytes=4096)   # small chunks: many messages per state
    comm.Barrier()


if __name__ == "__main__":
    from gyre_hpc.cells.fleet import guard_world   # imports MPI: under mpiexec only, never in pytest

    guard_world(main, Path(__file__).stem)   # one failed rank must not leave the others waiting

"""Run under ``mpiexec -n 3``: rank 0 routes, ranks 1 and 2 each serve a TorchEngine.

Rank 0 submits the requests (least outstanding tokens spreads them over both engines),
waits until every request has produced a few tokens, drains engine 1 (its sequences move
to rank 2 with their KV caches, point to point), runs everything to the end and writes
what the test checks to a JSON file. Then engine 1 goes through the rollout -> train -> rollout
flips (sleep, wake, stop, re-serve, new weights, open) and serves one more request.
Usage: mpi_migration_program.py MODEL_DIR OUT_JSON OTHER_MODEL_DIR.
"""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from gyre_hpc.engines import EngineError, Request, SamplingParams
from gyre_hpc.engines.mpi_engines import MPIEngines, serve_engine
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.engines.router import Router
from gyre_hpc.models.checkpoint import load_pretrained

MAX_NEW = 96
HOLD_AT = 4


class HoldingEngine(TorchEngine):
    """Engine 1 of the test: stops decoding once its requests are ``HOLD_AT`` tokens in, until
    the drain closes it. Without it a starved rank 0 (a loaded box) saw engine 1 decode all
    ``MAX_NEW`` tokens before its close arrived, and the drain had nothing in flight to move."""

    holding = True

    def step(self):
        if (self.holding and self._running and not self._queue and self._staged is None
                and all(len(s.tokens) >= HOLD_AT for s in self._running)):
            time.sleep(0.001)
            return []
        return super().step()

    def close_admission(self) -> None:
        self.holding = False
        super().close_admission()


def requests(prompts: list[list[int]]) -> list[Request]:
    """Greedy and seeded requests, ordered so that each engine gets one of each."""
    out = []
    for i, p in enumerate(prompts):
        seeded = i in (1, 2)
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9 if seeded else 0.0,
                                top_p=0.95 if seeded else 1.0, seed=1000 + i if seeded else None,
                                stop_token_ids=())
        out.append(Request(f"req{i}", tuple(p), params))
    return out


def controller(comm, prompts, out_path, other_dir) -> None:
    transport = MPIEngines(comm, {1: 1, 2: 2})
    router = Router(transport, [1, 2])
    reqs = requests(prompts)
    routed = {r.request_id: router.submit(r) for r in reqs}
    seen: dict[str, int] = {}
    # "Mid-decode": every request prefilled and a few tokens in, far from its budget.
    # Engine 1 (a HoldingEngine) stops decoding at HOLD_AT tokens, and is closed to admission
    # as soon as rank 0 sees its requests a few tokens in, so they are still mid-decode when
    # the drain comes, however unevenly a loaded machine schedules the three ranks.
    on_one = [rid for rid, e in routed.items() if e == 1]
    held = False
    while len(seen) < len(reqs) or min(seen.values()) < 3:
        for ev in router.poll():
            seen[ev.request_id] = ev.index + 1
        if not held and all(seen.get(rid, 0) >= 3 for rid in on_one):
            transport.close_admission(1)
            held = True
    before = transport.stats(2)["counters"]
    result = router.drain(1)
    outputs = router.run_until_done()
    after = transport.stats(2)["counters"]
    # The drained cell trains and comes back. Over MPI: sleep, wake, stop (its serve loop
    # returns and the rank is free to train), then the rank re-enters serve_engine and the
    # controller sends it new weights, opens it and routes to it again.
    transport.call(1, "sleep", 2)
    transport.call(1, "wake")
    transport.call(1, "stop")
    try:
        transport.stats(1)
        stopped_refused = None
    except EngineError as exc:
        stopped_refused = str(exc)
    transport.resume(1)
    version = transport.call(1, "load_weights", (load_pretrained(other_dir).state_dict(), 2))
    router.add_engine(1)
    back = Request("back", tuple(prompts[0]), SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=()))
    back_engine = router.submit(back)
    outputs += router.run_until_done()
    final = transport.stop()
    json.dump({
        "routed": routed, "back_engine": back_engine, "loaded_version": version, "stopped_refused": stopped_refused,
        "moved": dict(result.moved), "gone": list(result.gone), "tokens_at_move": dict(result.tokens_at_move),
        "bytes": result.bytes,
        "dest_before": dataclasses.asdict(before), "dest_after": dataclasses.asdict(after),
        "final": {str(e): dataclasses.asdict(c) for e, c in final.items()},
        "outputs": {o.request_id: {"token_ids": list(o.token_ids), "logprobs": list(o.logprobs),
                                   "migrations": o.migrations, "policy_version": o.policy_version}
                    for o in outputs},
    }, open(out_path, "w"))


def main() -> None:
    # Imported here, not at module level: the test imports ``requests`` from this file, and
    # initialising MPI inside pytest would leak singleton MPI state into every mpiexec it starts.
    from mpi4py import MPI

    torch.set_num_threads(1)
    model_dir, out_path = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD.Dup()
    prompts = json.load(open(f"{model_dir}/prompts.json"))
    if comm.Get_rank() == 0:
        controller(comm, prompts, out_path, sys.argv[3])
    else:
        kind = HoldingEngine if comm.Get_rank() == 1 else TorchEngine
        engine = kind.from_pretrained(model_dir, name=f"rank{comm.Get_rank()}")
        serve_engine(engine, comm, controller=0, chunk_bytes=4096)  # small chunks: a state crosses as many messages
        if comm.Get_rank() == 1:
            # The TRAIN phase would run here; the engine object (asleep, weights dropped) persists.
            serve_engine(engine, comm, controller=0)
    comm.Barrier()


if __name__ == "__main__":
    from gyre_hpc.cells.fleet import guard_world   # imports MPI: under mpiexec only, never in pytest

    guard_world(main, Path(__file__).stem)   # one failed rank must not leave the others waiting

"""``gyre-hpc bench migrate``: moving a mid-decode sequence with its KV cache versus
re-prefilling it on the destination, for 1K, 8K and 32K-token contexts on the tiny model
(``--model PATH``: a checkpoint folder; the default contexts it cannot hold are left out, and said).

What is timed:
- migrate (in-process): ``kv_export`` on the source + ``kv_import`` on a second engine in the
  same process (import copies the cache into the destination's own buffers);
- migrate (MPI): the same, with the state crossing between two ranks of ``mpiexec -n 2``
  through ``kv_transfer`` (header + chunked buffer Send/Recv). Timed as half a ping-pong
  (source -> destination -> source, each leg a full export + transfer + import), so no two
  clocks are compared;
- baseline, re-prefill: a fresh destination engine prefilling the same number of tokens
  (prompt + tokens generated so far) and sampling the next token: what a destination without
  migration must do before it can continue. Under MPI it runs on the destination rank while
  the source rank prefills the sequence to be migrated, so the two prefills overlap.

Each migration figure is the median of ``--repeats`` one-way moves. The ratio is
re-prefill time / migration time (how many times faster the move is).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import click

from gyre_hpc.bench.model_option import max_position, model_option

DEFAULT_CONTEXTS = (1024, 8192, 32768)
NEW_TOKENS = 8   # the moving request's budget: its prompt is the context less these, so the
                 # whole sequence fits a context of the model's max_position (32K: 32760 + 8)


def _engine(model, name: str):
    from gyre_hpc.engines.torch_engine import TorchEngine

    return TorchEngine(model, name=name, prefill_chunk=1024)


def _prompt(n: int) -> tuple[int, ...]:
    import torch

    from gyre_hpc.models.tiny_lm import BOS_ID

    g = torch.Generator().manual_seed(n)
    return (BOS_ID,) + tuple(torch.randint(0, 256, (n - 1,), generator=g).tolist())


def _request(rid: str, prompt: tuple[int, ...], max_new_tokens: int = NEW_TOKENS):
    from gyre_hpc.engines import Request, SamplingParams

    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=()))


def _prompt_len(context: int) -> int:
    return max(1, context - NEW_TOKENS)


def moving_request(context: int):
    """The request that is migrated: its prompt and budget fill exactly ``context`` positions."""
    return _request("moving", _prompt(_prompt_len(context)))


def baseline_request(context: int):
    """The re-prefill baseline: the moving request's prompt plus its first sampled token.

    Its budget is what the moving request has left after that token (``NEW_TOKENS - 1``), so it
    needs the same ``context`` positions. With the full budget it asked for ``context + 1`` and a
    32K context overran the tiny model's 32768 positions: the engine refused it on the re-prefill
    rank, and the other rank then waited in a barrier forever.
    """
    return _request("baseline", _prompt(_prompt_len(context)) + (0,), NEW_TOKENS - 1)


def _reprefill_s(model, context: int) -> float:
    """Baseline: a destination that has no cache prefills prompt + the first generated token."""
    dst = _engine(model, "reprefill")
    dst.submit(baseline_request(context))
    t0 = time.perf_counter()
    dst.step()
    return time.perf_counter() - t0


def _source_state(model, context: int):
    """A source engine holding one sequence mid-decode: prefilled, two tokens sampled."""
    src = _engine(model, "source")
    src.submit(moving_request(context))
    t0 = time.perf_counter()
    src.step()
    prefill_s = time.perf_counter() - t0
    src.step()
    return src, prefill_s


def _inprocess_migrate_s(src, repeats: int) -> float:
    dst = _engine(src.model, "destination")
    times = []
    a, b = src, dst
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.kv_import(a.kv_export("moving"))
        times.append(time.perf_counter() - t0)
        a, b = b, a
    if "moving" not in src.request_ids():
        src.kv_import(dst.kv_export("moving"))
    return statistics.median(times)


def measure(contexts: list[int], repeats: int, chunk_bytes: int, comm=None, model_path: str | None = None) -> dict | None:
    """The benchmark body; with ``comm`` (2 ranks) also the MPI path; with ``model_path`` on that
    checkpoint folder instead of the tiny preset. Rank 0 returns the figures."""
    import torch

    from gyre_hpc.bench.model_option import describe, load_model
    from gyre_hpc.engines.kv_transfer import recv_kv_state, send_kv_state
    from gyre_hpc.models.tiny_lm import build_model

    torch.set_num_threads(1)
    rank = comm.Get_rank() if comm is not None else 0
    model = load_model(model_path) if model_path else build_model("tiny", seed=0)
    layout = _engine(model, "probe").kv_layout
    results: dict[str, dict] = {}
    for context in contexts:
        row: dict[str, float] = {}
        if comm is not None:
            comm.Barrier()
        if rank == 0:
            src, row["source_prefill_s"] = _source_state(model, context)
            state_tokens = src.load().kv_tokens
            row["kv_tokens"] = state_tokens
            row["kv_mb"] = state_tokens * layout.bytes_per_token / 2**20
            row["migrate_inprocess_s"] = _inprocess_migrate_s(src, repeats)
        else:
            reprefill = _reprefill_s(model, context)
            dst = _engine(model, "destination")
        if comm is None:
            row["reprefill_s"] = _reprefill_s(model, context)
        else:
            comm.Barrier()
            legs = []
            for _ in range(repeats):
                if rank == 0:
                    t0 = time.perf_counter()
                    send_kv_state(comm, src.kv_export("moving"), 1, chunk_bytes)
                    state, _ = recv_kv_state(comm, 1)
                    src.kv_import(state)
                    legs.append((time.perf_counter() - t0) / 2)
                else:
                    state, _ = recv_kv_state(comm, 0)
                    dst.kv_import(state)
                    send_kv_state(comm, dst.kv_export("moving"), 0, chunk_bytes)
            if rank == 0:
                row["migrate_mpi_s"] = statistics.median(legs)
                row["reprefill_s"] = comm.recv(source=1, tag=7199)
            else:
                comm.send(reprefill, dest=0, tag=7199)
        if rank == 0:
            row["speedup_inprocess"] = row["reprefill_s"] / row["migrate_inprocess_s"]
            if "migrate_mpi_s" in row:
                row["speedup_mpi"] = row["reprefill_s"] / row["migrate_mpi_s"]
                row["mpi_gb_per_s"] = row["kv_mb"] * 2**20 / row["migrate_mpi_s"] / 1e9
            results[str(context)] = row
            src.drain()
    if rank != 0:
        return None
    return {
        "benchmark": "migrate",
        "model": {**describe(model_path, model, "tiny"), "kv_bytes_per_token": layout.bytes_per_token},
        "numerics": "invariant" if _engine(model, "probe").invariant else "native",
        "prompt_tokens": {str(c): _prompt_len(c) for c in contexts},
        "baseline": "re-prefill of the same context on the destination engine (no migration)",
        "ratio": "speedup_* = reprefill_s / migrate_*_s",
        "transport": "mpi+in-process" if comm is not None else "in-process",
        "repeats": repeats,
        "chunk_bytes": chunk_bytes,
        "contexts": results,
    }


def _contexts(contexts: str | None, model_path: str | None) -> tuple[list[int], dict[str, str]]:
    """The contexts to measure, and the defaults left out because the model cannot hold them (a
    context named in ``--contexts`` that it cannot hold is an error instead)."""
    from gyre_hpc.models.decoder import PRESETS

    limit, holder = ((max_position(model_path), f"the model at {model_path}") if model_path
                     else (PRESETS["tiny"].max_position, "the tiny model"))
    if contexts is None:
        ctx = [c for c in DEFAULT_CONTEXTS if c <= limit]
        return ctx, {str(c): f"{holder} holds at most {limit} tokens" for c in DEFAULT_CONTEXTS if c > limit}
    try:
        ctx = [int(c) for c in contexts.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"{contexts!r}: expected comma-separated integers, e.g. 1024,8192", param_hint="--contexts")
    if not ctx or min(ctx) < NEW_TOKENS + 2:
        raise click.BadParameter(f"{contexts!r}: each context must be >= {NEW_TOKENS + 2} tokens (a prompt and "
                                 f"{NEW_TOKENS} new)", param_hint="--contexts")
    if max(ctx) > limit:
        raise click.BadParameter(f"{contexts!r}: {holder} holds at most {limit} tokens", param_hint="--contexts")
    return ctx, {}


def _mpi_env() -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    return env


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--contexts", default=None,
              help=f"comma-separated context lengths in tokens [default: those of {','.join(map(str, DEFAULT_CONTEXTS))} "
                   "the model's positions hold]")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 50))
@click.option("--chunk-bytes", default=4 << 20, show_default=True, type=click.IntRange(1, None),
              help="MPI message size for the KV cache")
@click.option("--mpi/--no-mpi", default=True, show_default=True,
              help="also time the MPI path (mpiexec -n 2); without it, in-process only")
@model_option
@click.option("--worker", type=click.Path(dir_okay=False), hidden=True)
def command(as_json: bool, contexts: str | None, repeats: int, chunk_bytes: int, mpi: bool, model_path: str | None,
            worker: str | None) -> None:
    """KV migration of a mid-decode sequence vs re-prefill, at 1K/8K/32K tokens."""
    from gyre_hpc.report import emit

    ctx, skipped = _contexts(contexts, model_path)
    if worker is not None:  # inside mpiexec
        from mpi4py import MPI

        from gyre_hpc.cells.fleet import guard_world

        # An error on one rank must end both: the other would wait in a barrier forever.
        comm = MPI.COMM_WORLD.Dup()
        result = guard_world(lambda: measure(ctx, repeats, chunk_bytes, comm, model_path), "bench migrate",
                             MPI.COMM_WORLD)
        if result is not None:
            with open(worker, "w") as f:
                json.dump(result, f)
        return
    result = None
    why_not = None
    if mpi and shutil.which("mpiexec") is None:
        why_not = "mpiexec not on PATH"
    elif mpi:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "migrate.json")
            cmd = ["mpiexec", "-n", "2", "--oversubscribe", sys.executable, "-m", "gyre_hpc.bench.migrate",
                   "--worker", out, "--contexts", ",".join(map(str, ctx)), "--repeats", str(repeats),
                   "--chunk-bytes", str(chunk_bytes)] + (["--model", model_path] if model_path else [])
            proc = subprocess.run(cmd, env=_mpi_env(), capture_output=True, text=True)
            if proc.returncode == 0 and os.path.exists(out):
                with open(out) as f:
                    result = json.load(f)
            else:
                why_not = (f"mpiexec failed (rc={proc.returncode}): "
                           f"{(proc.stderr.strip() or proc.stdout.strip())[-800:]}")
    if result is None:
        result = measure(ctx, repeats, chunk_bytes, model_path=model_path)
        if why_not:
            result["mpi_skipped"] = why_not
    if skipped:
        result["contexts_skipped"] = skipped
    emit(result, as_json)


if __name__ == "__main__":
    command()

"""``gyre-hpc bench switch``: how long a cell takes to change role, and how fast weights move.

Runs the real fleet (scripted policy: every elastic cell flips every step) with a state
dict of ``--state-mb`` and reports the median rollout->train and train->rollout switch
times and the weight-transfer rate of rollout->train flips (``--model PATH``: as many bytes as
that checkpoint's parameters in float32, e.g. 513 MiB for SmolLM2-135M, carried by the substrate's
ballast: the bytes and the transfer path are the real width's, the tensor shapes are not). Also the engines' weight sync
(what follows every optimizer step: the core leader to every engine, ``WeightsChannel``)
against one raw ``Bcast`` of the same bytes over the same ranks. Baseline, in the same MPI
world just before the fleet starts: one plain ``Send``/``Recv`` of the same number of
bytes between the core cell's leader and another cell's leader, i.e. what the wire gives
one message with no chunking, headers or communicator re-derivation.

The same module is the rank program (``python -m gyre_hpc.bench.switch --ranks ...``),
started by the jobs part's launchers: ``mpiexec`` locally, one ``srun --mpi=pmix`` het step
over the local Slurm cluster's virtual nodes with ``--launcher slurm``.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import yaml

from gyre_hpc.bench import model_option
from gyre_hpc.report import emit


def _raw_send_seconds(world, nbytes: int, src: int, dst: int, repeats: int) -> list[float]:
    import torch
    from mpi4py import MPI

    # Torch memory like the weights' own: the allocator's page size alone moves MPI's
    # shared-memory bandwidth by 2-3x, so a numpy buffer would not be a like-for-like baseline.
    buf = torch.ones(nbytes, dtype=torch.uint8).numpy() if world.Get_rank() in (src, dst) else None
    times = []
    for _ in range(repeats):
        world.Barrier()
        t0 = time.perf_counter()
        if world.Get_rank() == src:
            world.Send([buf, MPI.BYTE], dest=dst, tag=77)
            world.Recv([buf[:1], MPI.BYTE], source=dst, tag=78)   # ack: time until the bytes landed
        elif world.Get_rank() == dst:
            world.Recv([buf, MPI.BYTE], source=src, tag=77)
            world.Send([buf[:1], MPI.BYTE], dest=src, tag=78)
        times.append(time.perf_counter() - t0)
    return times


def _engine_sync_seconds(world, nbytes: int, src: int, engines: list[int], repeats: int) -> dict[str, list[float]]:
    """The engines' weight sync (``WeightsChannel``: chunked, into the receivers' own tensors)
    and, beside it, one raw ``Bcast`` of the same bytes over the same members, each timed
    from a barrier until the last receiver has the bytes (a zero-byte gather)."""
    import torch
    from mpi4py import MPI

    from gyre_hpc.cells.weights import WeightsChannel

    members = (src, *engines)
    rank = world.Get_rank()
    inside = rank in members
    channel = WeightsChannel(world)
    half = nbytes // 2
    state = {"a.weight": torch.ones(half // 2, dtype=torch.bfloat16),
             "b.weight": torch.ones((nbytes - half) // 4, dtype=torch.float32)} if inside else None
    raw_buf = torch.ones(nbytes, dtype=torch.uint8).numpy() if inside else None
    group = world.Get_group().Incl(list(members))
    raw_comm = world.Create_group(group, 104) if inside else None
    out = {"sync_s": [], "raw_bcast_s": []}
    # One untimed round first: the channel builds its communicator once (kept for the run),
    # and first touches of the buffers fault their pages in; neither recurs per step.
    # The order alternates so neither side always runs second (warm caches, a neighbour's burst).
    for i in range(repeats + 1):
        for key in (("raw_bcast_s", "sync_s") if i % 2 else ("sync_s", "raw_bcast_s")):
            world.Barrier()
            t0 = time.perf_counter()
            if inside:
                if key == "sync_s":
                    (channel.push(state, members) if rank == src else channel.receive(state, members))
                else:
                    raw_comm.Bcast([raw_buf, MPI.BYTE], root=0)
                raw_comm.gather(None, root=0)
            if i:
                out[key].append(time.perf_counter() - t0)
    channel.close()
    if raw_comm is not None:
        raw_comm.Free()
    group.Free()
    return out


def ranks_main(run_dir: str, out: str, repeats: int = 3) -> int:
    """Every rank: baseline transfer, then the fleet; rank 0 writes the raw figures to ``out``."""
    from mpi4py import MPI

    from gyre_hpc.cells.fleet import guard_world, run_fleet
    from gyre_hpc.cells.plan import core_cell, plan_cells
    from gyre_hpc.config import load_config
    from gyre_hpc.substrate.fleet import substrate_options

    world = MPI.COMM_WORLD

    def measure():
        cfg = load_config(Path(run_dir) / "config.yaml")
        cells = plan_cells(cfg.cells)
        src = core_cell(cells).leader
        dst = next(c.leader for c in cells if c.leader != src)
        nbytes = int(cfg.model.substrate_state_mb * (1 << 20))
        raw = world.bcast(_raw_send_seconds(world, nbytes, src, dst, repeats), root=src)
        engines = [c.leader for c in cells if c.leader != src]
        sync = world.bcast(_engine_sync_seconds(world, nbytes, src, engines, 4 * repeats), root=src)
        return nbytes, raw, engines, sync, run_fleet(run_dir, substrate_options(), world)

    nbytes, raw, engines, sync, result = guard_world(measure, "switch bench", world)
    if world.Get_rank() == 0:
        Path(out).write_text(json.dumps({
            "raw_send_s": raw, "raw_bytes": nbytes, "exit_code": result.exit_code,
            "engine_sync_s": sync["sync_s"], "raw_bcast_s": sync["raw_bcast_s"], "engines": len(engines),
            "thp_mem_alloc": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
            "world_size": world.Get_size(),
            "flips": [f.__dict__ for f in result.flips],
            "steps": [{"step": s.step, "wall_s": s.wall_s} for s in result.steps]}))
        return result.exit_code
    return int(result)


def summarize(raw: dict, state_mb: float, launcher: str) -> dict:
    """The benchmark's figures from the rank program's raw output (pure: tested without MPI)."""
    to_train = [f for f in raw["flips"] if f["to"] == "TRAIN"]
    to_rollout = [f for f in raw["flips"] if f["to"] == "ROLLOUT"]
    if not to_train or not to_rollout:
        raise RuntimeError(f"the fleet made {len(to_train)} rollout->train and {len(to_rollout)} "
                           "train->rollout flips; need at least one of each (raise --flips)")
    mb = raw["raw_bytes"] / (1 << 20)
    # The rate of the weight transfer itself (chunked broadcast), and of the whole flip.
    rates = [f["bytes"] / (1 << 20) / f["transfer_s"] for f in to_train if f["transfer_s"] > 0]
    flip_rates = [f["bytes"] / (1 << 20) / f["duration_s"] for f in to_train]
    raw_s = statistics.median(raw["raw_send_s"])
    r2t = statistics.median(f["duration_s"] for f in to_train)
    rate = statistics.median(rates) if rates else float("nan")

    def spread(flips: list[dict]) -> dict:
        return {"median": statistics.median(f["duration_s"] for f in flips),
                "min": min(f["duration_s"] for f in flips), "max": max(f["duration_s"] for f in flips),
                "comm_s_median": statistics.median(f["comm_s"] for f in flips),
                "transfer_s_median": statistics.median(f["transfer_s"] for f in flips)}

    return {
        "benchmark": "switch",
        "launcher": launcher,
        "state_mb": state_mb,
        "world_size": raw["world_size"],
        "torch_huge_pages": raw.get("thp_mem_alloc") == "1",
        "flips": {"rollout_to_train": len(to_train), "train_to_rollout": len(to_rollout)},
        "rollout_to_train_s": spread(to_train),
        "train_to_rollout_s": spread(to_rollout),
        "weight_transfer_MBps": {"median": rate, "whole_flip_median": statistics.median(flip_rates),
                                 "bytes_per_flip": to_train[0]["bytes"]},
        "baseline": {
            "what": "one MPI Send/Recv of the same bytes (torch memory) between the core leader and another cell leader, same world",
            "seconds": {"median": raw_s, "all": raw["raw_send_s"]},
            "MBps": mb / raw_s,
        },
        "ratio": {
            "transfer_MBps_over_baseline_MBps": rate / (mb / raw_s),
            "rollout_to_train_s_over_baseline_s": r2t / raw_s,
        },
    } | engine_sync_summary(raw)


def engine_sync_summary(raw: dict) -> dict:
    """Engine weight sync (core leader -> every engine, after each optimizer step) vs a raw
    Bcast of the same bytes over the same ranks; {} for output of an older rank program."""
    if not raw.get("engine_sync_s"):
        return {}
    mb = raw["raw_bytes"] / (1 << 20)
    sync_s, bcast_s = statistics.median(raw["engine_sync_s"]), statistics.median(raw["raw_bcast_s"])
    return {"engine_weight_sync": {
        "what": "WeightsChannel (chunked bcast into the engines' own tensors) from the core leader to "
                f"{raw['engines']} engines, vs one raw MPI Bcast of the same bytes over the same ranks",
        "seconds": {"median": sync_s, "all": raw["engine_sync_s"]},
        "MBps": mb / sync_s,
        "raw_bcast": {"seconds": {"median": bcast_s, "all": raw["raw_bcast_s"]}, "MBps": mb / bcast_s},
        "ratio_MBps_over_raw_bcast": bcast_s / sync_s,
        # Each sync is timed next to a raw Bcast (the order alternates): the median of those
        # pairs' ratios is less moved by a neighbour's burst on a shared machine than the
        # ratio of the two medians; the best of each side is the uncontended cost.
        "ratio_pairs_median": statistics.median(b / s for s, b in zip(raw["engine_sync_s"], raw["raw_bcast_s"])),
        "ratio_of_best": min(raw["raw_bcast_s"]) / min(raw["engine_sync_s"]),
    }}


def _fleet_config(state_mb: float, flips: int, launcher: str) -> dict:
    # 3 cells, core 0: cell 1 flips at step 1, then cells 1 and 2 flip in opposite directions
    # every step, so N+1 steps give N flips each way at least.
    return {"name": "bench-switch", "launcher": launcher,
            "cells": {"count": 3, "ranks_per_cell": 1, "core": 0},
            "scheduler": {"policy": "scripted"},
            "model": {"substrate_state_mb": state_mb},
            "train": {"steps": flips + 1, "checkpoint_every": flips + 1}}


def usable_slurm_nodes() -> list[str]:
    """Nodes sinfo reports up (idle, mixed or allocated: srun queues for busy ones); at least 3."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    if out.returncode != 0:
        raise click.ClickException(f"sinfo failed ({out.stderr.strip()}); start the cluster: gyre-hpc cluster up")
    nodes = sorted({line.split()[0] for line in out.stdout.splitlines()
                    if line.split() and line.split()[1].rstrip("*~#") in ("idle", "mixed", "mix", "allocated", "alloc",
                                                                         "completing")})
    if len(nodes) < 3:
        raise click.ClickException(f"--launcher slurm needs >= 3 nodes that are up, sinfo shows {nodes} "
                                   f"(all: {out.stdout.split()})")
    return nodes


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--state-mb", type=float, default=100.0, show_default=True, help="state dict size moved per flip")
@model_option.model_option
@click.option("--flips", type=int, default=5, show_default=True, help="flips per direction (at least)")
@click.option("--launcher", type=click.Choice(["local", "slurm"]), default="local", show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=900.0, show_default=True)
@click.option("--keep", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="run directory to keep (default: a temporary one)")
def command(as_json: bool, state_mb: float, model_path: str | None, flips: int, launcher: str, timeout_s: float,
            keep: Path | None) -> None:
    """Median role-switch times and weight MB/s vs one raw MPI Send/Recv of the same bytes."""
    from gyre_hpc.config import build_config
    from gyre_hpc.jobs.launchers import LocalLauncher, SlurmLauncher
    from gyre_hpc.jobs.plan import local_plan, plan_for_nodes

    if flips < 1:
        raise click.BadParameter("--flips must be at least 1")
    model = None
    if model_path is not None:
        # What a flip and a weight sync cost depends on the bytes moved: the checkpoint's, in
        # float32 as the trainer and engines hold them (the substrate's ballast carries them).
        model = model_option.meta_model(model_path)
        state_mb = model.n_params * 4 / (1 << 20)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-switch-") as tmp:
        run_dir = (keep or Path(tmp) / "run").resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = build_config(_fleet_config(state_mb, flips, launcher))
        (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
        out = run_dir / "bench-switch.json"
        argv = [sys.executable, "-m", "gyre_hpc.bench.switch", "--ranks", str(run_dir), str(out)]
        if launcher == "local":
            plan, runner = local_plan(cfg), LocalLauncher()
        else:
            plan, runner = plan_for_nodes(cfg, usable_slurm_nodes()), SlurmLauncher(mpi=cfg.slurm.mpi)
        log = run_dir / "logs" / "bench-switch.log"
        handle = runner.launch(plan, argv, log_path=log, cwd=run_dir)
        try:
            rc = handle.wait(timeout_s)
        except subprocess.TimeoutExpired:
            handle.kill()
            raise click.ClickException(f"the fleet did not finish in {timeout_s:.0f} s; see {log}")
        if rc != 0 or not out.exists():
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise click.ClickException(f"the fleet exited {rc}; log {log}:\n{tail}")
        result = summarize(json.loads(out.read_text()), state_mb, launcher)
        result["command"] = " ".join(handle.command)
        if model is not None:
            result["model"] = {**model_option.describe(model_path, model, "substrate"),
                               "moved_as": "substrate ballast of the checkpoint's float32 bytes"}
    emit(result, as_json)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--ranks":
        from gyre_hpc.cells.rank_env import prepare_rank_env
        prepare_rank_env()   # before MPI and torch start, as the fleet entry does
        sys.exit(ranks_main(sys.argv[2], sys.argv[3]))
    command()

"""Starting the fleet on every rank: resume, initial weight sync, then controller or cell loop.

Why every uncaught exception ends in ``Abort``: a rank that dies while the others sit in a
collective or wait for a command would leave them hanging until the job's time limit; the
supervisor can only relaunch a fleet that has ended. Abort ends the whole world (under
mpiexec and under srun) with a non-zero status.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from mpi4py import MPI

from gyre_hpc.cells import checkpoint, comms, weights
from gyre_hpc.cells.cell_rank import CellRank
from gyre_hpc.cells.controller import Controller, FleetResult
from gyre_hpc.cells.plan import CONTROLLER_RANK, core_cell, plan_cells, world_size
from gyre_hpc.cells.workload import SubstrateWorkload, Workload
from gyre_hpc.config import ConfigError, RunConfig, load_config
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter, recover_unclosed
from gyre_hpc.rundir.tensorboard import TensorBoardMirror, run_origin_s
from gyre_hpc.sched.state import Policy, Role

WorkloadFactory = Callable[[RunConfig, int], Workload]


def substrate_workload(cfg: RunConfig, rank: int) -> Workload:
    return SubstrateWorkload(cfg)


@dataclass(frozen=True)
class FleetOptions:
    workload: WorkloadFactory = substrate_workload
    policy: Policy | None = None            # None: the one cfg.scheduler names
    verify_weights: bool = False            # report state checksums on flips and steps (tests)
    chunk_bytes: int = weights.DEFAULT_CHUNK_BYTES
    reply_timeout_s: float = 600.0          # a cell rank silent this long fails the fleet


def resolve_policy(cfg: RunConfig) -> Policy:
    from gyre_hpc.sched.registry import policy_from_config
    try:
        return policy_from_config(cfg.scheduler)
    except ValueError as exc:
        raise ConfigError(f"scheduler.policy={cfg.scheduler.policy!r}: {exc}") from None


@dataclass(frozen=True)
class FleetStart:
    """What every rank of either fleet knows after start-up: config, cells, resume point, comms."""

    run: RunDir
    cfg: RunConfig
    cells: tuple
    rank: int
    latest: Path | None
    meta: checkpoint.CheckpointMeta | None
    cell_comm: MPI.Intracomm
    cells_comm: MPI.Intracomm | None
    train_comm: MPI.Intracomm | None

    @property
    def start_step(self) -> int:
        return self.meta.step + 1 if self.meta else 1


def start_fleet(run_dir: str | Path, world: MPI.Intracomm,
                check: Callable[[RunConfig], None] | None = None) -> FleetStart:
    """The start-up both fleets share: the world fits the plan, roles resume from ``latest``."""
    torch.set_num_threads(int(os.environ.get("GYRE_TORCH_THREADS", "1")))
    run = RunDir.at(run_dir)
    cfg = load_config(run.config)
    if check is not None:
        check(cfg)
    if world.Get_size() != world_size(cfg.cells):
        raise ConfigError(
            f"the MPI world has {world.Get_size()} ranks; cells.count={cfg.cells.count} x "
            f"cells.ranks_per_cell={cfg.cells.ranks_per_cell} + 1 controller needs {world_size(cfg.cells)}")
    latest = checkpoint.latest_dir(run.checkpoints)
    meta = checkpoint.read_meta(latest) if latest is not None else None
    roles = {int(c): Role(r) for c, r in meta.roles.items()} if meta else None
    cells = plan_cells(cfg.cells, roles)
    return FleetStart(run=run, cfg=cfg, cells=cells, rank=world.Get_rank(), latest=latest, meta=meta,
                      cell_comm=comms.split_cell_comm(world, cells),
                      cells_comm=comms.split_cells_comm(world, cells),
                      train_comm=comms.split_train_comm(world, cells))


def open_fleet_metrics(run: RunDir, cfg: RunConfig) -> MetricsWriter:
    """The controller's metrics writer; repairs a file a killed fleet left flagged as open.

    Nobody else writes while the fleet starts, so reopening here is safe whoever launched us.
    With ``metrics.tensorboard`` the step and engine rows also go to ``<run_dir>/tensorboard/``.
    """
    recovered = recover_unclosed(run.metrics)
    mirror = TensorBoardMirror(run.tensorboard, run_origin_s(run.metrics, time.time())) \
        if cfg.metrics.tensorboard else None
    metrics = MetricsWriter(run.metrics, mirror=mirror)
    if recovered:
        metrics.event("metrics_recovered", detail="previous writer died; rows copied to a fresh file")
    return metrics


def run_fleet(run_dir: str | Path, options: FleetOptions = FleetOptions(),
              world: MPI.Intracomm = MPI.COMM_WORLD) -> FleetResult | int:
    """Run this rank's part; the controller returns the FleetResult, cell ranks their exit code."""
    fs = start_fleet(run_dir, world)
    run, cfg, cells, rank, latest, meta = fs.run, fs.cfg, fs.cells, fs.rank, fs.latest, fs.meta
    cell_comm, cells_comm, train_comm = fs.cell_comm, fs.cells_comm, fs.train_comm
    if rank == CONTROLLER_RANK:
        run.make()
        policy = options.policy or resolve_policy(cfg)
        with open_fleet_metrics(run, cfg) as metrics:
            start = fs.start_step
            metrics.event("fleet_resume" if meta else "fleet_start", step=start,
                          detail=f"from {latest.name}" if latest else "fresh")
            ctl = Controller(world=world, cfg=cfg, run=run, cells=cells, policy=policy, metrics=metrics,
                             start_step=start, policy_version=meta.policy_version if meta else 0,
                             verify_weights=options.verify_weights, last_checkpointed=meta.step if meta else -1,
                             reply_timeout_s=options.reply_timeout_s)
            result = ctl.serve()
            metrics.event("fleet_exit", step=result.last_completed, detail=f"exit {result.exit_code}")
        return result

    workload = options.workload(cfg, rank)
    core = core_cell(cells)
    if latest is not None and rank == core.leader:
        _load_into(workload.state_dict(), checkpoint.load_state(latest), latest)
    # Every cell starts from the core's weights (fresh init or checkpoint): one broadcast.
    weights.bcast_state_dict(workload.state_dict() if rank == core.leader else None, cells_comm, root=0,
                             into=None if rank == core.leader else workload.state_dict(),
                             chunk_bytes=options.chunk_bytes)
    cell_rank = CellRank(world=world, cells=cells, workload=workload,
                         rank_comms=comms.RankComms(world=world, cell=cell_comm, train=train_comm),
                         chunk_bytes=options.chunk_bytes)
    return cell_rank.serve()


def _load_into(local: dict, stored: dict, where: Path) -> None:
    missing = sorted(set(local) - set(stored))
    extra = sorted(set(stored) - set(local))
    if missing or extra:
        raise checkpoint.CheckpointError(
            f"checkpoint {where}: tensors missing {missing}, unexpected {extra} for this model")
    for name, t in local.items():
        src = stored[name]
        if src.shape != t.shape or src.dtype != t.dtype:
            raise checkpoint.CheckpointError(
                f"checkpoint {where}: {name} is {src.dtype}{list(src.shape)}, the model has "
                f"{t.dtype}{list(t.shape)}")
        t.copy_(src)


def guard_world(entry, label: str, world: MPI.Intracomm):
    """Run ``entry()``; any exception on any rank ends the whole world.

    Why: a rank that dies alone leaves the others blocked in a collective forever, and the
    supervisor would wait on a hung step instead of relaunching it. Both fleets (the
    substrate and the rl workload) go through this one guard.
    """
    try:
        out = entry()
    except BaseException as exc:  # noqa: BLE001 - any failure must take the world down
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        sys.stderr.write(f"[{label} rank {world.Get_rank()}] fatal: {type(exc).__name__}: {exc}\n")
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        world.Abort(1)
        raise
    return out.exit_code if hasattr(out, "exit_code") else int(out)


def main_guarded(run_dir: str | Path, options: FleetOptions = FleetOptions(),
                 world: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """run_fleet, with any exception on any rank ending the whole world."""
    return guard_world(lambda: run_fleet(run_dir, options, world), "fleet", world)


# How long the controller waits, after MPI_Finalize, before it exits with a non-zero code.
CONTROLLER_EXIT_GRACE_S = 1.0


def exit_rank(code: int, world: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """End this rank after a clean stop; returns the exit status the controller should report.

    Why cell ranks leave first and with 0: ``srun --kill-on-bad-exit`` (and mpiexec) end every
    rank as soon as one exits non-zero, and the launcher then reports the killed ranks' 143
    instead of 75. So only the controller carries the fleet's code, and it exits after the
    others: they leave right after ``MPI_Finalize`` (``os._exit``, no interpreter teardown),
    it waits ``CONTROLLER_EXIT_GRACE_S`` first when the code is not 0.
    """
    is_controller = world.Get_rank() == CONTROLLER_RANK
    if not MPI.Is_finalized():
        MPI.Finalize()
    if not is_controller:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if code != 0:
        time.sleep(CONTROLLER_EXIT_GRACE_S)
    return code

"""Starting the fleet on every rank: resume, initial weight sync, then controller or serve loop.

Why every uncaught exception ends in ``Abort``: a rank that dies while the others sit in a
collective or wait for a command would leave them hanging until the job's time limit; the
supervisor can only relaunch a fleet that has ended. Abort ends the whole world (under
mpiexec and under srun) with a non-zero status.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from mpi4py import MPI

from gyre_hpc import fsio
from gyre_hpc.cells import checkpoint, comms, weights
from gyre_hpc.cells.cell_rank import CellRank, RankHandler
from gyre_hpc.cells.controller import Controller, FleetResult, StepDriver
from gyre_hpc.cells.plan import CONTROLLER_RANK, core_cell, plan_cells, world_size
from gyre_hpc.cells.rank_state import RankState
from gyre_hpc.cells.step_rows import restore_step_rows
from gyre_hpc.config import ConfigError, RunConfig, load_config
from gyre_hpc.rundir import disk_full, fleet_error
from gyre_hpc.rundir.contract import EXIT_DISK_FULL
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter, Mirrors, recover_unclosed
from gyre_hpc.rundir.tensorboard import TensorBoardMirror, run_origin_s
from gyre_hpc.sched.state import Policy, Role


@dataclass(frozen=True)
class FleetStart:
    """What every rank knows after start-up: config, cells, resume point, communicators."""

    run: RunDir
    cfg: RunConfig
    cells: tuple
    rank: int
    latest: Path | None
    meta: checkpoint.CheckpointMeta | None
    cell_comm: MPI.Intracomm
    cells_comm: MPI.Intracomm | None
    train_comm: MPI.Intracomm | None
    engine_comm: MPI.Intracomm        # the engine service's own tags (``engines.mpi_engines``)

    @property
    def start_step(self) -> int:
        return self.meta.step + 1 if self.meta else 1


@dataclass(frozen=True)
class FleetWorkload:
    """A workload as the fleet runs it; the fleet itself is the same for all.

    ``rank_workload`` builds a cell rank's state (flips move its ``state_dict``, checkpoints
    hold it); ``rank_handler`` answers the workload's own commands inside the one serve loop;
    ``step_driver`` runs on the controller rank and drives each step through the controller's
    messaging (it may enter contexts, e.g. open the tree store, on ``stack``). Each workload
    above ``cells`` (``gyre_hpc.rl``, ``gyre_hpc.substrate``) builds one of these and starts
    the fleet with it; ``cells`` knows none of them.
    """

    name: str
    rank_workload: Callable[[RunConfig, int], RankState]
    step_driver: Callable[[Controller, FleetStart, contextlib.ExitStack], StepDriver]
    rank_handler: Callable[[FleetStart, CellRank], RankHandler | None] = lambda fs, cell_rank: None
    check: Callable[[RunConfig], None] | None = None


@dataclass(frozen=True)
class FleetOptions:
    workload: FleetWorkload                 # what the fleet runs (``rl.fleet``, ``substrate.fleet``)
    policy: Policy | None = None            # None: the one cfg.scheduler names
    verify_weights: bool = False            # report state checksums on flips and steps (tests)
    chunk_bytes: int = weights.DEFAULT_CHUNK_BYTES
    reply_timeout_s: float = 600.0          # a cell rank silent this long fails the fleet
    result_path: str | None = None          # rank 0 writes the FleetResult here as JSON (tests, benchmarks)


def resolve_policy(cfg: RunConfig) -> Policy:
    """The policy ``cfg.scheduler`` names. Paced cells stand for a device model, so elastic is
    sized from it exactly as the simulator sizes it (``sched.elastic.device_sized``), with the
    ``scheduler.elastic`` fields the config sets over it: the simulator forecasts this policy."""
    from gyre_hpc.sched.elastic import ElasticPolicy, device_sized
    from gyre_hpc.sched.registry import policy_from_config
    try:
        policy = policy_from_config(cfg.scheduler)
        if cfg.scheduler.policy == "elastic" and cfg.cells.device == "paced":
            engine, train = cfg.cells.pace.devices()
            return ElasticPolicy(device_sized(engine, train, cfg.scheduler.elastic))
        return policy
    except ValueError as exc:
        raise ConfigError(f"scheduler.policy={cfg.scheduler.policy!r}: {exc}") from None


def start_fleet(run_dir: str | Path, world: MPI.Intracomm,
                check: Callable[[RunConfig], None] | None = None) -> FleetStart:
    """Start-up on every rank: the world fits the plan, roles resume from ``latest``."""
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
                      train_comm=comms.split_train_comm(world, cells),
                      engine_comm=world.Dup())


def open_fleet_metrics(run: RunDir, cfg: RunConfig) -> MetricsWriter:
    """The controller's metrics writer; repairs a file a killed fleet left flagged as open.

    Nobody else writes while the fleet starts, so reopening here is safe whoever launched us.
    With ``metrics.tensorboard`` the step and engine rows also go to ``<run_dir>/tensorboard/``;
    with ``metrics.wandb`` to Weights & Biases (offline files under ``<run_dir>/wandb/`` by default).
    """
    recovered = recover_unclosed(run.metrics)
    origin = run_origin_s(run.metrics, time.time())
    mirrors = []
    if cfg.metrics.tensorboard:
        mirrors.append(TensorBoardMirror(run.tensorboard, origin))
    if cfg.metrics.wandb is not None:
        from gyre_hpc.rundir.wandb_mirror import WandbMirror

        w = cfg.metrics.wandb
        mirrors.append(WandbMirror(run.root, w.project, w.mode, origin, name=cfg.name, entity=w.entity,
                                   config=cfg.model_dump(mode="json")))
    metrics = MetricsWriter(run.metrics, mirror=Mirrors(mirrors) if mirrors else None)
    if recovered:
        metrics.event("metrics_recovered", detail="previous writer died; rows copied to a fresh file")
    return metrics


def run_fleet(run_dir: str | Path, options: FleetOptions,
              world: MPI.Intracomm = MPI.COMM_WORLD) -> FleetResult | int:
    """Run this rank's part; the controller returns the FleetResult, cell ranks their exit code."""
    wl = options.workload
    fs = start_fleet(run_dir, world, check=wl.check)
    run, cfg, cells, rank, latest, meta = fs.run, fs.cfg, fs.cells, fs.rank, fs.latest, fs.meta
    if rank == CONTROLLER_RANK:
        run.make()
        policy = options.policy or resolve_policy(cfg)
        with contextlib.ExitStack() as stack:
            metrics = stack.enter_context(open_fleet_metrics(run, cfg))
            if latest is not None:   # rows the latest checkpoint sealed that a kill kept out of metrics.h5
                metrics.append(restore_step_rows(latest, run.metrics))
            start = fs.start_step
            ctl = Controller(world=world, cfg=cfg, run=run, cells=cells, policy=policy, metrics=metrics,
                             start_step=start, policy_version=meta.policy_version if meta else 0,
                             verify_weights=options.verify_weights, last_checkpointed=meta.step if meta else -1,
                             reply_timeout_s=options.reply_timeout_s)
            ctl.driver = wl.step_driver(ctl, fs, stack)
            metrics.event("fleet_resume" if meta else "fleet_start", step=start,
                          detail=f"{wl.name} from {latest.name}" if latest else f"{wl.name} fresh")
            result = ctl.serve()
            metrics.event("fleet_exit", step=result.last_completed, detail=f"exit {result.exit_code}")
        if options.result_path:
            Path(options.result_path).write_text(json.dumps(dataclasses.asdict(result), indent=1, default=str))
        return result

    workload = wl.rank_workload(cfg, rank)
    core = core_cell(cells)
    if latest is not None and rank == core.leader:
        workload.load(latest)
    # Every cell starts from the core's weights (fresh init or checkpoint): one broadcast.
    weights.bcast_into(workload.state_dict(), fs.cells_comm, chunk_bytes=options.chunk_bytes)
    cell_rank = CellRank(world=world, cells=cells, workload=workload,
                         rank_comms=comms.RankComms(world=world, cell=fs.cell_comm, train=fs.train_comm),
                         chunk_bytes=options.chunk_bytes)
    cell_rank.handler = wl.rank_handler(fs, cell_rank)
    return cell_rank.serve()


def guard_world(entry, label: str, world: MPI.Intracomm = MPI.COMM_WORLD, run_dir: str | Path | None = None):
    """``entry()``'s result; any exception on any rank ends the whole world.

    Why: a rank that dies alone leaves the others blocked in a collective forever, and the
    supervisor would wait on a hung step instead of relaunching it. A write that found the
    disk full (with ``run_dir`` known) is reported to the head (``rundir.disk_full``) and ends
    the world with ``EXIT_DISK_FULL``: the head then stops instead of relaunching. Any other
    error is reported too (``rundir.fleet_error``): the head stops relaunching a fleet that
    fails the same way twice from the same checkpoint.
    """
    try:
        out = entry()
    except BaseException as exc:  # noqa: BLE001 - any failure must take the world down
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        code = 1
        sys.stderr.write(f"[{label} rank {world.Get_rank()}] fatal: {type(exc).__name__}: {exc}\n")
        traceback.print_exc(file=sys.stderr)
        if run_dir is not None and fsio.is_disk_full(exc):
            code = EXIT_DISK_FULL
            message = disk_full.report(RunDir.at(run_dir), exc, world.Get_rank())
            sys.stderr.write(f"[{label} rank {world.Get_rank()}] disk full, stopping the fleet: {message}\n")
        elif run_dir is not None and isinstance(exc, Exception):
            fleet_error.report(RunDir.at(run_dir), exc, world.Get_rank())
        sys.stderr.flush()
        world.Abort(code)
        raise
    return out


def main_guarded(run_dir: str | Path, options: FleetOptions,
                 world: MPI.Intracomm = MPI.COMM_WORLD) -> int:
    """run_fleet, with any exception on any rank ending the whole world."""
    out = guard_world(lambda: run_fleet(run_dir, options, world), f"{options.workload.name} fleet", world, run_dir)
    return out.exit_code if hasattr(out, "exit_code") else int(out)


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


def rank_main(prog: str, description: str, options: FleetOptions, argv: list[str] | None = None) -> int:
    """The command line of a workload's fleet module (``python -m gyre_hpc.rl``,
    ``gyre_hpc.substrate``): ``--run-dir``, the guarded run, the clean exit of ``exit_rank``."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml")
    args = parser.parse_args(argv)
    return exit_rank(main_guarded(args.run_dir, options))

"""The head job's process: pick the plan for where it runs, install signal handlers, supervise.

``python -m gyre_hpc.jobs.head CONFIG [--set key=value ...]`` is what ``sbatch/gyre_head.sh``
execs and what ``gyre-hpc run`` calls in the foreground. Where it runs decides the plan:

- ``launcher: local``: ``mpiexec`` on this machine, wherever that is;
- ``launcher: slurm`` in a het job (``SLURM_HET_SIZE``): the job's het groups;
- ``launcher: slurm`` in a plain allocation (submitit): a het step over the allocation's nodes;
- ``launcher: slurm`` with no allocation: ``srun`` asks Slurm for a het job of its own.

Signals: USR2 (Slurm's warning before the time limit, ``--signal=B:USR2@s``) drains the fleet
and requeues the job; SIGTERM (scancel, the limit itself) and Ctrl-C drain without requeue:
whoever sent them decides what comes next (Slurm requeues preempted jobs itself).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Mapping

from gyre_hpc.config import WORKLOADS, ConfigError, RunConfig, load_config
from gyre_hpc.jobs import plan as fleet_plan
from gyre_hpc.jobs.launchers import expand_nodelist, launcher_for
from gyre_hpc.jobs.supervisor import Supervisor, SupervisorResult, requeue_slurm_job
from gyre_hpc.rundir.layout import RunDir


def plan_for_environment(cfg: RunConfig, env: Mapping[str, str], expand=expand_nodelist) -> fleet_plan.FleetPlan:
    if cfg.launcher == "local":
        return fleet_plan.local_plan(cfg)
    if "SLURM_HET_SIZE" in env:
        return fleet_plan.plan_for_het_job(cfg, env, expand=expand)
    if "SLURM_JOB_NODELIST" in env:
        return fleet_plan.plan_for_nodes(cfg, expand(env["SLURM_JOB_NODELIST"]),
                                         fleet_plan.cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE")))
    return fleet_plan.local_plan(cfg)


def in_batch_step(env: Mapping[str, str]) -> bool:
    """The batch script of a Slurm job (not a step inside it): the only place a requeue makes sense."""
    return "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env


def make_supervisor(cfg: RunConfig, env: Mapping[str, str] | None = None) -> Supervisor:
    env = os.environ if env is None else env
    run = RunDir.at(cfg.run_dir)
    plan = plan_for_environment(cfg, env)
    requeue = None
    if in_batch_step(env):
        job_id = env["SLURM_JOB_ID"]
        requeue = lambda: requeue_slurm_job(job_id)  # noqa: E731
    return Supervisor(cfg=cfg, run=run, launcher=launcher_for(cfg.launcher, mpi=cfg.slurm.mpi), plan=plan,
                      requeue=requeue)


def install_signal_handlers(sup: Supervisor) -> None:
    def on_usr2(signum, frame):
        sup.request_stop("USR2", requeue=True)

    def on_term(signum, frame):
        sup.request_stop("SIGTERM", requeue=False)

    def on_int(signum, frame):
        if sup.stop is not None:
            raise KeyboardInterrupt  # second Ctrl-C: stop waiting for the checkpoint
        sup.log("Ctrl-C: asking the fleet to checkpoint and exit (again to abort)")
        sup.request_stop("SIGINT", requeue=False)

    signal.signal(signal.SIGUSR2, on_usr2)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)


def run_head(cfg: RunConfig) -> SupervisorResult:
    sup = make_supervisor(cfg)
    install_signal_handlers(sup)
    sup.log(f"run dir {sup.run.root}: metrics {sup.run.metrics.name}, checkpoints/, logs/; "
            f"{cfg.launcher} launcher, {sup.plan.world_size} ranks ({cfg.cells.count} cells)")
    try:
        result = sup.run_fleet()
    except KeyboardInterrupt:
        if sup.handle is not None:
            sup.handle.kill()
        raise
    # After `scontrol requeue` Slurm SIGTERMs this step; nothing is left to do.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sup.log(f"{result.status}: {result.message}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gyre_hpc.jobs.head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if not WORKLOADS[cfg.workload].step_progress:
            return run_head(cfg).exit_code
        # A batch job's output file: one line per step as it lands, beside the supervisor's.
        from gyre_hpc.jobs.progress import progress_display

        with progress_display(cfg):
            return run_head(cfg).exit_code
    except ConfigError as exc:
        print(f"gyre head: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

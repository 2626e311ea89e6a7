"""``gyre_hpc.submit(cfg)``: the head job through submitit, from a Python session or notebook.

submitit has no heterogeneous jobs, so the allocation is plain (one node per cell, plus one
for the head when ``spare_head_node``) and the fleet becomes a heterogeneous *step* over it
(see plan.plan_for_nodes). Settings that make signals and requeue work, each learned the hard
way and recorded in design.md:

- ``use_srun=False``: the head runs once, in the batch step, so it can start its own steps;
- ``python="exec <python>"`` and ``--signal=B:USR2@s``: the batch shell becomes python and the
  warning signal reaches it, so submitit's handler calls ``HeadJob.checkpoint``;
- ``HeadJob.checkpoint`` drains the fleet (control file, exit 75) *before* returning the
  DelayedSubmission that submitit pickles and requeues: the next start resumes from it.

Collect with ``wait_for_result(job)`` (or ``job.task(0).result()`` where sacct works):
``job.results()`` waits for every task.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import submitit
from submitit.helpers import Checkpointable, DelayedSubmission

from gyre_hpc.config import RunConfig, build_config
from gyre_hpc.rundir.layout import RunDir


class HeadJob(Checkpointable):
    """The head as a submitit callable; holds only the config text so it pickles cleanly."""

    def __init__(self, config_yaml: str):
        self.config_yaml = config_yaml
        self._supervisor = None

    def config(self) -> RunConfig:
        import yaml
        return build_config(yaml.safe_load(self.config_yaml), source="submitted config")

    def __call__(self) -> dict:
        from gyre_hpc.jobs.head import make_supervisor

        cfg = self.config()
        # submitit owns USR2 (it calls checkpoint()); SIGTERM it bypasses. Requeue is submitit's
        # job too, so the supervisor gets no requeue function of its own.
        sup = make_supervisor(cfg)
        sup.requeue = None
        self._supervisor = sup
        # submitit ignores SIGTERM ("bypass"); scancel would then look like a dying fleet and
        # be relaunched until the kill. Treat it as the sbatch head does: drain and stop.
        signal.signal(signal.SIGTERM, lambda signum, frame: sup.request_stop("SIGTERM", requeue=False))
        sup.log(f"submitit head: run dir {sup.run.root}, {sup.plan.world_size} ranks")
        result = sup.run_fleet()
        if result.status in ("failed", "refused"):
            raise RuntimeError(result.message)
        return result.to_dict()

    def checkpoint(self, *args, **kwargs) -> DelayedSubmission:
        if self._supervisor is not None:
            self._supervisor.drain("USR2 (submitit)", requeue=True)
        return DelayedSubmission(HeadJob(self.config_yaml))

    def __getstate__(self) -> dict:
        return {"config_yaml": self.config_yaml}

    def __setstate__(self, state: dict) -> None:
        self.config_yaml = state["config_yaml"]
        self._supervisor = None


def executor_for(cfg: RunConfig, folder: Path, python: str = sys.executable,
                 spare_head_node: bool = True) -> submitit.SlurmExecutor:
    c = cfg.cells
    nodes = c.count * c.nodes_per_cell + (1 if spare_head_node else 0)
    ex = submitit.SlurmExecutor(folder=str(folder), python=f"exec {python}")
    extra: dict = {"requeue": True, "signal": f"B:USR2@{cfg.slurm.signal_s}"}
    if cfg.slurm.account:
        extra["account"] = cfg.slurm.account
    params = dict(
        job_name=cfg.name, time=cfg.slurm.time_min, nodes=nodes, ntasks_per_node=1,
        cpus_per_task=max(cfg.slurm.head_cpus, c.ranks_per_cell * c.cpus_per_rank),
        signal_delay_s=cfg.slurm.signal_s, use_srun=False, additional_parameters=extra,
    )
    if cfg.slurm.partition:
        params["partition"] = cfg.slurm.partition
    if c.mem_per_cell_mb:
        params["mem"] = f"{c.mem_per_cell_mb}M"
    ex.update_parameters(**params)
    return ex


def submission_script(cfg: RunConfig, folder: Path, spare_head_node: bool = True) -> str:
    """The sbatch script submitit would write for this head job (``submit --dry-run``).

    submitit has no public dry run; its executor renders the script with the same two calls
    its own submit makes, so what is printed is what would be submitted."""
    ex = executor_for(cfg, folder, spare_head_node=spare_head_node)
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def submit(cfg: RunConfig, folder: str | Path | None = None, spare_head_node: bool = True) -> submitit.Job:
    """Submit the head job; returns the submitit Job (``job.task(0).result()`` waits for it)."""
    if cfg.launcher != "slurm":
        cfg = cfg.model_copy(update={"launcher": "slurm"})
    run = RunDir.at(cfg.run_dir).make()
    cfg = cfg.model_copy(update={"run_dir": str(run.root)})
    folder = Path(folder) if folder is not None else run.root / "submitit"
    ex = executor_for(cfg, folder, spare_head_node=spare_head_node)
    return ex.submit(HeadJob(cfg.to_yaml()))


ENDED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def job_state(job_id: str) -> str | None:
    """The job's state as ``scontrol`` shows it (no accounting needed); None once it forgot the job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=20)
    m = re.search(r"JobState=(\S+)", out.stdout) if out.returncode == 0 else None
    return m.group(1) if m else None


def wait_for_result(job: submitit.Job, timeout_s: float | None = None, poll_s: float = 1.0,
                    grace_s: float = 10.0):
    """The head's result, also where Slurm keeps no accounting.

    submitit learns that a job died only from ``sacct``; without accounting storage
    ``job.task(0).result()`` waits forever for a job that ended without a result. Here
    ``scontrol`` (which keeps finished jobs for MinJobAge) says when to stop waiting, and the
    error carries the end of the job's log.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    ended_at = None
    while deadline is None or time.monotonic() < deadline:
        if job.paths.result_pickle.exists():
            return job.task(0).result()
        if job_state(job.job_id) in ENDED_STATES:
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > grace_s:
                log = job.paths.stdout.read_text()[-3000:] if job.paths.stdout.exists() else "(no log)"
                raise RuntimeError(f"submitit job {job.job_id} ended without a result; its log ends:\n{log}")
        time.sleep(poll_s)
    raise TimeoutError(f"submitit job {job.job_id} gave no result within {timeout_s:.0f} s")

"""The head job's supervisor: launch the fleet, watch it, relaunch it, drain it before requeue.

It is not an MPI rank. It owns three decisions:

- a fleet that fails (killed step, lost node, crash) is relaunched from the last checkpoint,
  up to ``supervise.max_relaunches`` times, then the run fails with a message naming the log;
  a fleet that found the run directory's disk full (``rundir.disk_full``) is not relaunched:
  the run stops at once naming the file and the space, and resumes once space is freed;
  a fleet that fails twice from the same checkpoint with the same error (``rundir.fleet_error``,
  written by the rank that raised it) is not relaunched again: the run fails naming the error;
- a stop request (USR2 before the time limit, SIGTERM, Ctrl-C, or submitit's checkpoint call)
  becomes ``control/checkpoint-and-exit``; the fleet checkpoints and exits 75;
- after a drained stop it requeues the Slurm job when asked to (USR2), so the next start
  resumes from the checkpoint the fleet just sealed.

Why ``metrics.h5`` is opened only around launches: HDF5 allows one writer, and while the
fleet runs that writer is the controller rank. The supervisor's ``events`` rows (launch,
exit, relaunch, requeue, resume, finish, fail) are written while no fleet runs.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from gyre_hpc import fsio
from gyre_hpc.jobs.preflight import check_workload_config
from gyre_hpc.config import WORKLOADS, ConfigError, RunConfig, load_config
from gyre_hpc.jobs.launchers import FleetHandle, Launcher, LaunchError
from gyre_hpc.jobs.ownership import HeadLock, RunDirInUse, check_rerun, live_fleet, reap_stray_sruns
from gyre_hpc.jobs.plan import FleetPlan
from gyre_hpc.rundir import disk_full, fleet_error
from gyre_hpc.rundir.contract import EXIT_CHECKPOINTED, EXIT_DISK_FULL, EXIT_DONE
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import MetricsWriter, read_table, recover_unclosed

TERM_WAIT_S = 2.0  # how long a SIGTERM'd head waits for the fleet before recording the stop


@dataclass(frozen=True)
class SupervisorResult:
    status: str          # finished | requeued | stopped | failed | refused (the directory is not ours)
    exit_code: int       # what the head process should exit with
    launches: int
    last_step: int | None
    message: str

    def to_dict(self) -> dict:
        return {"status": self.status, "exit_code": self.exit_code, "launches": self.launches,
                "last_step": self.last_step, "message": self.message}


@dataclass
class StopRequest:
    reason: str          # USR2, SIGTERM, SIGINT, submitit, ...
    requeue: bool        # requeue the Slurm job once the fleet has checkpointed


def latest_checkpoint_step(run: RunDir) -> int | None:
    """The last completed step the fleet sealed, or None before the first checkpoint."""
    from gyre_hpc.cells import checkpoint  # torch import; only when a checkpoint matters

    latest = checkpoint.latest_dir(run.checkpoints)
    return None if latest is None else checkpoint.read_meta(latest).step


def _from(step: int | None) -> str:
    return "the start" if step is None else f"the checkpoint of step {step}"


def fleet_argv(run: RunDir, python: str = sys.executable, workload: str = "substrate") -> list[str]:
    """What every rank runs: the workload's fleet entry point (``config.WORKLOADS``), started as a
    process; the head never imports the workloads above ``cells``."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload={workload!r}: valid workloads are {sorted(WORKLOADS)}")
    return [python, *WORKLOADS[workload].fleet, "--run-dir", str(run.root)]


def requeue_slurm_job(job_id: str) -> None:
    """``scontrol requeue``; Slurm then SIGTERMs this batch step and starts it again later."""
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job_id} failed: {out.stderr.strip()}")


@dataclass
class Supervisor:
    cfg: RunConfig
    run: RunDir
    launcher: Launcher
    plan: FleetPlan
    argv: list[str] | None = None
    requeue: Callable[[], None] | None = None   # how to requeue this job; None outside Slurm
    log: Callable[[str], None] = field(default=lambda msg: print(f"[head] {msg}", flush=True))
    drain_timeout_s: float | None = None        # default: most of slurm.signal_s

    handle: FleetHandle | None = field(default=None, init=False)
    stop: StopRequest | None = field(default=None, init=False)
    launches: int = field(default=0, init=False)
    _drained: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.argv is None:
            self.argv = fleet_argv(self.run, workload=self.cfg.workload)
        if self.drain_timeout_s is None:
            self.drain_timeout_s = max(10.0, 0.8 * self.cfg.slurm.signal_s)

    # -- called from signal handlers: only set state and touch a file --------------------------

    def request_stop(self, reason: str, requeue: bool) -> None:
        """Ask the fleet to checkpoint and exit; the first request decides whether to requeue."""
        if self.stop is None:
            self.stop = StopRequest(reason=reason, requeue=requeue)
        self.run.exit_request.touch()

    # -- the loop ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Write the resolved config, set the disk-full reserve aside and clear a stop request
        left by the previous start (``DiskFullError`` if the disk is still full)."""
        self.run.make()
        resolved = self.cfg.model_copy(update={"run_dir": str(self.run.root)})
        fsio.write_text(self.run.config, resolved.to_yaml())
        disk_full.set_aside(self.run)
        flag = self.run.exit_request
        step = latest_checkpoint_step(self.run)
        if step is not None:
            flag.unlink(missing_ok=True)
            restart = os.environ.get("SLURM_RESTART_COUNT", "0")
            self.event("resume", step, f"from checkpoint step {step}; slurm restart {restart}")
            self.log(f"resuming after step {step}")
        elif flag.exists():
            flag.unlink()

    def run_fleet(self) -> SupervisorResult:
        """Own the run directory (see ``ownership``) for as long as the fleet is supervised."""
        try:
            check_workload_config(self.cfg, log=self.log)
        except ConfigError as exc:
            return self._refuse(f"invalid config: {exc}")
        try:
            lock = HeadLock.acquire(self.run)
        except RunDirInUse as exc:
            return self._refuse(str(exc))
        try:
            for stray in reap_stray_sruns(self.run):
                self.log(f"killed a stray srun client of an ended step: {stray}")
            alive = live_fleet(self.run)
            if alive:
                return self._refuse(f"an earlier fleet of {self.run.root} is still running: {'; '.join(alive)}; "
                                    f"stop it (kill the pid / scancel the step) before starting a head here")
            try:
                check_rerun(self.run, self.cfg, self._stored_config())
            except RunDirInUse as exc:
                return self._refuse(str(exc))
            return self._supervise()
        finally:
            lock.release()

    def _stored_config(self) -> RunConfig | None:
        if not self.run.config.exists():
            return None
        try:
            return load_config(self.run.config)
        except ConfigError as exc:
            raise RunDirInUse(f"{self.run.config} (the config of the run this directory holds) no longer "
                              f"loads, so a rerun cannot be checked against it: {exc}") from None

    def _refuse(self, message: str) -> SupervisorResult:
        """Nothing of the directory is touched: it may belong to someone else's live run."""
        self.log(f"REFUSED: {message}")
        return SupervisorResult("refused", 2, 0, None, message)

    def _supervise(self) -> SupervisorResult:
        try:
            self.prepare()
        except fsio.DiskFullError as exc:
            return self._disk_full(str(exc), latest_checkpoint_step(self.run), before_launch=True)
        failures: list[str] = []
        last_failure, last_log = (None, None), None   # the last failed launch: (its error, its start step), its log
        while True:
            if self.stop is not None:
                return self._finish_stop(None)
            step = latest_checkpoint_step(self.run)
            kind = "launch" if self.launches == 0 else "relaunch"
            self.event(kind, -1 if step is None else step,
                       f"attempt {self.launches + 1} via {self.launcher.name}, world {self.plan.world_size}")
            log_path = self.run.logs / f"fleet-{int(time.time())}-{self.launches + 1}.log"
            self.renew_lease()   # before launch: a lease an earlier head left behind is stale
            fleet_error.clear(self.run)
            started_from = step
            try:
                self.handle = self.launcher.launch(self.plan, self.argv, log_path=log_path, cwd=self.run.root)
            except LaunchError as exc:
                return self._fail(str(exc), step)
            self.launches += 1
            self.log(f"{kind} {self.launches}: {' '.join(self.handle.command[:3])} ... (log {log_path})")
            launched_at = time.time()
            rc = self._reconcile_exit(self._watch(self.handle), launched_at)
            self.run.head_alive.unlink(missing_ok=True)   # no fleet: no lease (a fleet run by hand has none)
            step = latest_checkpoint_step(self.run)
            self.event("exit", -1 if step is None else step,
                       f"fleet exit {rc}, step {self.handle.step_id or '-'}")
            self.handle = None
            if rc == EXIT_DONE:
                self.event("finish", step, f"all {self.cfg.train.steps} steps done")
                return SupervisorResult("finished", 0, self.launches, step,
                                        f"finished {self.cfg.train.steps} steps in {self.launches} launch(es)")
            if rc == EXIT_CHECKPOINTED or self.stop is not None:
                return self._finish_stop(rc)
            full = disk_full.read(self.run, since=launched_at - 5)
            if full is not None or rc == EXIT_DISK_FULL:
                message = full["message"] if full else f"the fleet exited {rc} (disk full); see {log_path}"
                return self._disk_full(message, step)
            error = fleet_error.read(self.run, since=launched_at - 5)
            failures.append(f"exit {rc}" + (f", {error}" if error else "") + f" ({log_path})")
            failure = (error, started_from)
            if fleet_error.same_failure(last_failure, failure):
                return self._fail(
                    f"fleet failed twice from {_from(started_from)} with the same error, {error}; a relaunch "
                    f"would start from the same state and fail again. Fix the cause and run the same command "
                    f"again: it resumes from {_from(started_from)}. Logs: {last_log}, {log_path}", step)
            last_failure, last_log = failure, log_path
            if len(failures) > self.cfg.supervise.max_relaunches:
                return self._fail(
                    f"fleet failed {len(failures)} times, more than supervise.max_relaunches="
                    f"{self.cfg.supervise.max_relaunches}: " + "; ".join(failures), step)
            self.log(f"fleet failed with exit {rc}; relaunching from step {step} "
                     f"({len(failures)}/{self.cfg.supervise.max_relaunches})")

    def renew_lease(self) -> None:
        """The head is alive: its fleet reads this file's age (``Controller.head_gone``)."""
        self.run.control.mkdir(parents=True, exist_ok=True)
        self.run.head_alive.touch()

    def _watch(self, handle: FleetHandle) -> int:
        self._record_step(handle)
        known_step = None
        term_at = None
        while True:
            self.renew_lease()
            rc = handle.poll()
            if rc is not None:
                if getattr(handle, "orphaned", False):
                    self.log(f"srun hung at the end of its step {handle.step_id} (its step gone, or every task "
                             f"exited); killed it")
                return rc
            if self.stop is not None and self.stop.reason == "SIGTERM":
                # Slurm SIGKILLs everything KillWait (often 5-30 s) after SIGTERM; the fleet is
                # being killed alongside, so record the stop now instead of waiting on srun.
                term_at = term_at or time.monotonic()
                if time.monotonic() - term_at > TERM_WAIT_S:
                    return 128 + signal.SIGTERM
            if known_step is None and handle.step_id is not None:
                known_step = handle.step_id
                self._record_step(handle)
                self.log(f"fleet is Slurm step {known_step}")
            time.sleep(self.cfg.supervise.poll_s)

    def _reconcile_exit(self, rc: int, launched_at: float) -> int:
        """The controller's own word on how the fleet ended, when srun's code garbles it.

        With ``--kill-on-bad-exit`` the first rank to exit 75 makes srun kill the others, and a
        rank caught in MPI teardown then reports SIGTERM (143): srun's code is the worst task's.
        The controller records ``fleet_exit`` ("exit N") in metrics.h5 before exiting, so a clean
        0 or 75 recorded during this launch is what the fleet meant.
        """
        if rc in (EXIT_DONE, EXIT_CHECKPOINTED, EXIT_DISK_FULL):
            return rc
        try:
            with _signals_held():
                recover_unclosed(self.run.metrics)
                ev = read_table(self.run.metrics, "events")
        except Exception as exc:  # noqa: BLE001 - a damaged file must not take the head down
            self.log(f"cannot read fleet_exit from {self.run.metrics.name}: {exc}")
            return rc
        for t, name, detail in zip(ev["time"][::-1], ev["event"][::-1], ev["detail"][::-1]):
            if t < launched_at - 5:
                break
            if name != "fleet_exit":
                continue
            if detail in (f"exit {EXIT_DONE}", f"exit {EXIT_CHECKPOINTED}"):
                recorded = int(detail.split()[1])
                self.log(f"srun exited {rc}; the controller recorded {detail}: taking {recorded}")
                return recorded
            break
        return rc

    def _record_step(self, handle: FleetHandle) -> None:
        """Where the running fleet is: tools (and tests) read this to find the step to act on."""
        info = {"step_id": handle.step_id, "pid": handle.pid, "launch": self.launches, "time": time.time(),
                "command": handle.command}
        try:
            fsio.write_text(self.run.logs / "fleet.json", json.dumps(info))
        except fsio.DiskFullError as exc:   # the fleet will meet the full disk too, and say so
            self.log(f"cannot record the fleet's step: {exc}")

    def drain(self, reason: str, requeue: bool) -> int | None:
        """Synchronous stop for callers that cannot return to the loop (submitit's checkpoint()).

        Touches the control file, waits for the fleet's exit (75 expected), kills it past the
        drain timeout (the previous checkpoint is then the resume point) and records the event.
        """
        self.request_stop(reason, requeue)
        rc = None
        if self.handle is not None:
            try:
                rc = self.handle.wait(self.drain_timeout_s)
            except subprocess.TimeoutExpired:
                self.log(f"fleet did not checkpoint within {self.drain_timeout_s:.0f} s; killing it")
                rc = self.handle.kill()
        self._drained = True
        step = latest_checkpoint_step(self.run)
        self.event("requeue" if requeue else "stop", -1 if step is None else step,
                   f"{reason}: fleet exit {rc}, resume after step {step}")
        return rc

    def _finish_stop(self, rc: int | None) -> SupervisorResult:
        step = latest_checkpoint_step(self.run)
        stop = self.stop or StopRequest(reason="control file", requeue=False)
        if rc is not None and rc != EXIT_CHECKPOINTED:
            self.log(f"fleet exited {rc} instead of {EXIT_CHECKPOINTED} while stopping; "
                     f"the resume point is the last checkpoint (step {step})")
        if stop.requeue and self.requeue is not None:
            if not self._drained:
                self.event("requeue", -1 if step is None else step,
                           f"{stop.reason}: fleet exit {rc}, resume after step {step}")
            self.log(f"{stop.reason}: checkpointed at step {step}; requeueing")
            try:
                self.requeue()
            except RuntimeError as exc:
                return self._fail(str(exc), step)
            return SupervisorResult("requeued", 0, self.launches, step, f"requeued after step {step}")
        if not self._drained:
            self.event("stop", -1 if step is None else step, f"{stop.reason}: fleet exit {rc}")
        return SupervisorResult("stopped", EXIT_CHECKPOINTED, self.launches, step,
                                f"stopped ({stop.reason}) after step {step}; run again to resume")

    def _disk_full(self, message: str, step: int | None, before_launch: bool = False) -> SupervisorResult:
        """A relaunch would only fill the same disk again: stop, saying what to free."""
        where = "before launching the fleet" if before_launch else "the fleet stopped"
        resume = f"resumes after step {step}" if step is not None else "starts from the beginning"
        return self._fail(f"disk full, {where}: {message}. Nothing committed is lost: free space there "
                          f"and run the same command again; it {resume}", step)

    def _fail(self, message: str, step: int | None) -> SupervisorResult:
        self.event("fail", -1 if step is None else step, message)
        self.log(f"FAILED: {message}")
        return SupervisorResult("failed", 1, self.launches, step, message)

    def event(self, name: str, step: int | None, detail: str) -> None:
        # Signals are held while the file is open: submitit's USR2 handler calls drain(), which
        # writes an event too, and must not find this process's own writer mid-row.
        try:
            self._write_event(name, step, detail)
        except Exception as exc:
            if not fsio.is_disk_full(exc):
                raise
            # The file is as it was; it is repaired (or appended to) once space is freed.
            self.log(f"event {name!r} not recorded in {self.run.metrics.name}: the disk is full "
                     f"({fsio.space_report(self.run.metrics)})")

    def _write_event(self, name: str, step: int | None, detail: str) -> None:
        with _signals_held():
            # Only ever called while no fleet runs, so an unclosed file means a killed writer.
            try:
                if recover_unclosed(self.run.metrics):
                    self.log(f"{self.run.metrics.name} was left open by a killed writer; rewrote it, rows kept")
            except OSError as exc:
                if fsio.is_disk_full(exc):
                    raise
                # Unreadable even for SWMR readers: keep it for forensics, go on with a fresh file.
                aside = self.run.metrics.with_name(f"metrics.h5.corrupt-{int(time.time())}")
                fsio.replace_file(self.run.metrics, aside)
                self.log(f"{self.run.metrics.name} is unreadable ({exc}); moved to {aside.name}, starting a new one")
            with MetricsWriter(self.run.metrics) as metrics:
                metrics.event(name, -1 if step is None else step, detail)


@contextlib.contextmanager
def _signals_held():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signal.SIGUSR2, signal.SIGTERM, signal.SIGINT}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)

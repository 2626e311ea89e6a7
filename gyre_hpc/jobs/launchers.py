"""Launchers: turn a FleetPlan into one running MPI world, and hand back something to watch.

One interface, two implementations, one conformance suite (tests/jobs/test_launchers.py):

- ``LocalLauncher``: ``mpiexec`` on this machine, MPMD blocks in component order.
- ``SlurmLauncher``: one ``srun --mpi=<plugin>`` step. Inside a het job the components are
  the job's het groups (``--het-group=0,1,..``); anywhere else a heterogeneous *step*
  (``srun A : B : ...``, each block with its own ``--nodelist``), which is how a plain
  submitit allocation gets one MPI world spanning differently shaped cells.

Why handles find their step id through ``scontrol show step``: srun does not print it, and
the step's ``SrunHost:Pid`` names the very srun process we started, so the match cannot pick
up someone else's step.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Mapping, Sequence

from gyre_hpc.jobs.plan import FleetPlan

FLEET_GUARD = Path(__file__).with_name("fleet_guard.py")


class LaunchError(RuntimeError):
    """The launcher could not start the fleet; the message says which binary or setting."""


def exit_status(returncode: int) -> int:
    """Shell convention: a process killed by signal N reports 128+N, never a negative code."""
    return 128 - returncode if returncode < 0 else returncode


class FleetHandle(ABC):
    """A running fleet: poll it, wait for it, kill it. Exit codes follow the fleet contract."""

    def __init__(self, proc: subprocess.Popen, command: list[str], log_path: Path | None):
        self.proc = proc
        self.command = command
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        rc = self.proc.poll()
        return None if rc is None else exit_status(rc)

    def wait(self, timeout: float | None = None) -> int:
        return exit_status(self.proc.wait(timeout))

    @property
    @abstractmethod
    def step_id(self) -> str | None:
        """``<jobid>.<stepid>`` of the Slurm step; None where there is no Slurm step."""

    @abstractmethod
    def kill(self, grace_s: float = 5.0) -> int:
        """End every rank; returns the exit status."""


class Launcher(ABC):
    name: str

    @abstractmethod
    def command(self, plan: FleetPlan, argv: list[str]) -> list[str]:
        """The full command line that starts ``argv`` on every rank of ``plan``."""

    @abstractmethod
    def launch(self, plan: FleetPlan, argv: list[str], log_path: Path | None = None,
               env: Mapping[str, str] | None = None, cwd: Path | None = None) -> FleetHandle:
        """Start the fleet and return at once."""


# What an Open MPI singleton (a process that imported mpi4py.MPI without mpiexec) leaves in
# its C environment, and so in every child it starts: a launcher given these believes it is
# already a rank of that singleton and mpiexec exits 1 without a word. Users' own MCA
# settings (OMPI_MCA_btl=..., OMPI_ALLOW_RUN_AS_ROOT) are not in this list and pass through.
_MPI_SINGLETON_PREFIXES = ("PMIX_", "ORTE_", "OMPI_APP_CTX_", "OMPI_MCA_ess", "OMPI_MCA_orte_",
                           "OMPI_MCA_pmix", "OMPI_COMM_WORLD_", "OMPI_FIRST_RANKS", "OMPI_NUM_APP_CTX")


def fleet_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for fleet ranks: one BLAS/torch thread per rank (ranks already fill the cores).

    Always passed explicitly and without an MPI singleton's variables: a head started by a
    process that had imported mpi4py (a pytest run, a notebook) inherits them at start.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_SINGLETON_PREFIXES)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GYRE_TORCH_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def _popen(command: list[str], log_path: Path | None, env: dict[str, str], cwd: Path | None,
           pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    out = subprocess.DEVNULL
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab")
    try:
        # Own session: a kill reaches the launcher and everything it forked, nothing of ours.
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, cwd=cwd, start_new_session=True, pass_fds=pass_fds)
    finally:
        if out is not subprocess.DEVNULL:
            out.close()


def _guarded_popen(command: list[str], log_path: Path | None, env: dict[str, str],
                   cwd: Path | None) -> tuple[subprocess.Popen, int]:
    """``command`` under ``fleet_guard``, which ends it when this process dies, however it dies.
    Returns the process and the write end of the life pipe (kept open while the fleet runs)."""
    life_read, life_write = os.pipe()   # non-inheritable: no other child of the head holds it
    try:
        # By file, stdlib only: works whatever PYTHONPATH the fleet is given.
        guard = [sys.executable, "-I", str(FLEET_GUARD), str(life_read), "--", *command]
        return _popen(guard, log_path, env, cwd, pass_fds=(life_read,)), life_write
    except BaseException:
        os.close(life_write)
        raise
    finally:
        os.close(life_read)


# --------------------------------------------------------------------------- local


class LocalHandle(FleetHandle):
    def __init__(self, proc, command, log_path, life_fd: int | None = None):
        super().__init__(proc, command, log_path)
        self._life_fd = life_fd   # closing it (or this process dying) ends the fleet

    @property
    def step_id(self) -> str | None:
        return None

    def poll(self) -> int | None:
        rc = super().poll()
        if rc is not None:
            self._close_life()
        return rc

    def wait(self, timeout: float | None = None) -> int:
        rc = super().wait(timeout)
        self._close_life()
        return rc

    def _close_life(self) -> None:
        if self._life_fd is not None:
            os.close(self._life_fd)
            self._life_fd = None

    def kill(self, grace_s: float = 5.0) -> int:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        return self.wait()


class LocalLauncher(Launcher):
    """``mpiexec`` on this machine; components become MPMD blocks so rank order matches the plan."""

    name = "local"

    def __init__(self, mpiexec: str = "mpiexec", extra_args: list[str] = ()):
        self.mpiexec = mpiexec
        self.extra_args = list(extra_args)

    def command(self, plan: FleetPlan, argv: list[str]) -> list[str]:
        # More ranks than cores is the normal case on a laptop or CI box.
        cmd = [self.mpiexec, "--oversubscribe", *self.extra_args]
        for i, comp in enumerate(plan.components):
            if i:
                cmd.append(":")
            cmd += ["-n", str(comp.ntasks), *argv]
        return cmd

    def launch(self, plan, argv, log_path=None, env=None, cwd=None) -> LocalHandle:
        exe = shutil.which(self.mpiexec)
        if exe is None:
            raise LaunchError(f"{self.mpiexec} not on PATH; install Open MPI with `scripts/install-system.sh`")
        run_env = fleet_env(env)
        if os.geteuid() == 0:
            # Open MPI refuses root unless told twice (containers and CI run as root).
            run_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            run_env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        command = self.command(plan, argv)
        proc, life_fd = _guarded_popen(command, log_path, run_env, cwd)
        return LocalHandle(proc, command, log_path, life_fd)


# --------------------------------------------------------------------------- slurm

_STEP_RE = re.compile(r"StepId=(\d+)\.(\w+?)(?:\+(\d+))?\s.*?SrunHost:Pid=(\S+):(\d+)")


def find_step(srun_host: str, srun_pid: int, prefer_job: str | None = None) -> str | None:
    """The ``<job>.<step>`` that the srun process ``srun_host:srun_pid`` runs, or None if not yet.

    A het step lists once per component (``10.0+0``, ``10.0+1``); a step over a het job lists
    once per component job (``7.0``, ``8.0``, ``9.0``); either way the het leader's id (the
    job's own ``SLURM_JOB_ID``, else the lowest) is the one ``scancel`` takes for the whole step.
    """
    out = subprocess.run(["scontrol", "show", "step", "-o"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        return None
    found = []
    for line in out.stdout.splitlines():
        m = _STEP_RE.search(line)
        if m and m.group(4) == srun_host and int(m.group(5)) == srun_pid:
            found.append((m.group(1), m.group(2)))
    if not found:
        return None
    for job, step in found:
        if job == prefer_job:
            return f"{job}.{step}"
    job, step = min(found, key=lambda js: int(js[0]))
    return f"{job}.{step}"


def node_hosts() -> list[str]:
    """The host every Slurm node runs on (``NodeHostName``), one entry per node; empty if
    ``scontrol`` does not answer."""
    out = subprocess.run(["scontrol", "-o", "show", "node"], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        return []
    return re.findall(r"\bNodeHostName=(\S+)", out.stdout)


def yield_when_idle(world_size: int, hosts: Callable[[], Sequence[str]], host: str, cores: int) -> bool:
    """Whether a fleet's MPI ranks must give up the CPU while they wait in a collective.

    Open MPI spins in a blocking call unless it knows its node is oversubscribed. ``mpiexec
    --oversubscribe`` tells it; ``srun`` cannot, when the nodes are virtual ones of this host
    (the local cluster: 4 nodes of 4 CPUs each on 2 cores). Then every waiting rank spins on
    the cores the others need, and each hop of a collective waits for a scheduler time
    slice: measured on this machine (9 ranks over 4 virtual nodes, TCP), a 3.2 MB allreduce
    took 0.17-0.33 s and a ``Create_group`` 0.15-0.30 s spinning, 13-39 ms and 1-33 ms
    yielding; paper-local's 8-replica update 0.56-0.61 s spinning, 0.06-0.08 s yielding
    (docs/jobs.md). Only when every node is this host (the fleet's ranks all run here) and
    they outnumber its cores: on real nodes spinning is the faster wait. ``hosts`` (``node_hosts``)
    lists every Slurm node, one controller query on a cluster of thousands of nodes, so it is
    asked only when the ranks do outnumber the cores."""
    if world_size <= cores:
        return False
    names = hosts()
    return bool(names) and all(h == host for h in names)


def tcp_only(packed: bool, hosts: Callable[[], Sequence[str]]) -> bool:
    """Whether a fleet's ranks must leave Open MPI's shared-memory transport for TCP.

    Open MPI names a node's shared-memory (vader) segments by host name and local rank, so
    ranks on two Slurm nodes that are one host (the local cluster's virtual nodes) map each
    other's segments and segfault in their first collective (seen: 3 launches in 3, in a
    packed step, whose cells fill one virtual node and spill onto the next; het steps were
    never seen to and are left as they were). Only nodes that share a host (``NodeHostName``)
    collide: on real nodes, ranks of a packed step that share one keep shared memory, far
    faster than TCP over loopback. A listing that fails (empty) keeps TCP: a crash is worse
    than a slower transport."""
    if not packed:
        return False
    names = hosts()
    return not names or len(set(names)) < len(names)


def expand_nodelist(nodelist: str) -> list[str]:
    """``c[1-3]`` -> ``['c1','c2','c3']`` by Slurm's own parser."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
    if out.returncode != 0:
        raise LaunchError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip()}")
    return out.stdout.split()


# srun -v prints one of these per exit message it gets (22.05: "srun: launch/slurm: _task_finish:
# Received ...", later releases drop the prefix); the status is the raw wait status.
_TASK_EXIT_RE = re.compile(rb"^srun: .*?Received task exit notification for (\d+) tasks? of .*?"
                           rb"\(status=0x([0-9a-fA-F]+)\)", re.M)


def tasks_exit_code(exits: list[tuple[int, int]], ntasks: int) -> int | None:
    """The step's exit code from srun's task exit notifications ``(tasks, wait status)``, or
    None until they cover all ``ntasks`` tasks. 0 when every task exited 0; otherwise the first
    abnormal end (128+N for signal N): with ``--kill-on-bad-exit`` that task is the cause and
    the later ones are srun's kill of the rest."""
    if sum(n for n, _ in exits) < ntasks:
        return None
    for _, status in exits:
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            return exit_status(code)
    return 0


class SlurmHandle(FleetHandle):
    """A running srun, and a watchdog over a bug of srun 22.05's pmix plugin: after a het step's
    tasks have all ended, srun can hang joining its abort agent (here in 15 of 115 short het
    steps) or die in a double free. Either way srun has already printed (``-v``) an exit
    notification for every task, so the step's code is read from those (``tasks_exit_code``).
    srun is killed once its step has left ``scontrol show step`` for ``teardown_grace_s`` with
    every task's exit in hand, or for ``orphan_grace_s`` without; ``orphaned`` then says so, and
    a hang without every exit reports 137 instead of being waited on forever. The hang can also
    keep the step listed (seen once in CI: three tasks exited 0, srun and its step still there
    120 s later), so with every exit in hand srun is killed after ``exited_grace_s`` whether or
    not Slurm still lists the step, and the step is cancelled with it: a normal teardown takes
    about a second, and a lingering step would hold its nodes from the next launch.
    """

    def __init__(self, proc, command, log_path, prefer_job: str | None, orphan_grace_s: float = 60.0,
                 ntasks: int | None = None, log_offset: int = 0, teardown_grace_s: float = 5.0,
                 exited_grace_s: float = 30.0):
        super().__init__(proc, command, log_path)
        self._prefer_job = prefer_job
        self._step_id: str | None = None
        self._host = socket.gethostname()
        self.orphan_grace_s = orphan_grace_s
        self.teardown_grace_s = teardown_grace_s
        self.exited_grace_s = exited_grace_s
        self._gone_since: float | None = None
        self._exited_since: float | None = None   # when every task's exit was first in hand
        self._last_check = 0.0
        self._ntasks = ntasks
        self._log_pos = log_offset          # the log is appended to across launches: ours starts here
        self._exits: list[tuple[int, int]] = []
        self._killing = False                  # srun's signal death is then ours, not the bug
        self._orphan_code: int | None = None   # what a killed orphan reports, every poll after

    @property
    def orphaned(self) -> bool:
        """The watchdog killed srun after its step had gone."""
        return self._orphan_code is not None

    @property
    def tasks_reported(self) -> int:
        """Task exits srun has logged for this launch so far (all of them: the code is the
        tasks' own, whatever srun did afterwards)."""
        self._tasks_code()
        return len(self._exits)

    def _tasks_code(self) -> int | None:
        """The step's exit code from srun's task exit notifications so far (None: not all in, or
        no log or task count to read them against)."""
        if self._ntasks is None or self.log_path is None:
            return None
        with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as f:
            f.seek(self._log_pos)
            chunk = f.read()
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self._log_pos += len(complete)
            self._exits += [(int(n), int(st, 16)) for n, st in _TASK_EXIT_RE.findall(complete)]
        return tasks_exit_code(self._exits, self._ntasks)

    def _srun_code(self) -> int | None:
        """srun's exit status, or the tasks' where srun died of a signal nobody here sent it (the
        double free) after every task's exit was in."""
        rc = self.proc.poll()
        if rc is None:
            return None
        if rc < 0 and not self._killing:
            code = self._tasks_code()
            if code is not None:
                return code
        return exit_status(rc)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.command, timeout)
            time.sleep(0.2)

    def poll(self) -> int | None:
        if self._orphan_code is not None:
            return self._orphan_code
        rc = self._srun_code()
        if rc is not None:
            return rc
        now = time.monotonic()
        # scontrol at most every 2 s: a pending het job may sit in the queue for long.
        if now - self._last_check < 2.0:
            return None
        self._last_check = now
        code = self._tasks_code()
        if code is not None:
            self._exited_since = self._exited_since or now
            if now - self._exited_since >= self.exited_grace_s:
                return self._kill_hung(code, cancel_step=True)
        if self._step_id is None:
            self.step_id  # learn it while the step runs, so a hang after it can be recognised
            if self._step_id is not None:
                return None
        elif find_step(self._host, self.proc.pid, self._prefer_job) is not None:
            self._gone_since = None
            return None
        if self._step_id is None and code is None:
            return None   # not started yet; a step shorter than a check is known by its tasks' exits
        self._gone_since = self._gone_since or now
        grace = self.orphan_grace_s if code is None else self.teardown_grace_s
        if now - self._gone_since < grace or self.proc.poll() is not None:
            return self._srun_code()
        return self._kill_hung(137 if code is None else code)

    def _kill_hung(self, code: int, cancel_step: bool = False) -> int:
        """srun killed as hung; ``code`` is what every later poll reports (``orphaned``)."""
        self._killing = True
        self._kill_srun(cancel_step)
        self.proc.wait()
        self._orphan_code = code
        return code

    def _kill_srun(self, cancel_step: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self._step_id is None:
            return
        if self._prefer_job is None:
            # srun made this allocation itself (no surrounding job): killed, it cannot release it.
            subprocess.run(["scancel", self._step_id.split(".")[0]], capture_output=True, timeout=10)
        elif cancel_step:
            # Inside the head's allocation the job stays; a step still listed would hold its nodes.
            subprocess.run(["scancel", self._step_id], capture_output=True, timeout=10)

    @property
    def step_id(self) -> str | None:
        if self._step_id is None and self.proc.poll() is None:
            self._step_id = find_step(self._host, self.proc.pid, self._prefer_job)
        return self._step_id

    def wait_step_id(self, timeout_s: float = 60.0) -> str:
        """Block until Slurm has started the step (het jobs wait for backfill)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.step_id is not None:
                return self._step_id  # type: ignore[return-value]
            if self.proc.poll() is not None:
                raise LaunchError(f"srun exited ({self.poll()}) before its step appeared; see {self.log_path}")
            time.sleep(0.2)
        raise LaunchError(f"no Slurm step for srun pid {self.proc.pid} after {timeout_s:.0f} s; see {self.log_path}")

    def kill(self, grace_s: float = 5.0) -> int:
        if self.proc.poll() is None:
            self._killing = True
            step = self.step_id
            if step is not None:
                subprocess.run(["scancel", step], capture_output=True, timeout=10)
            else:
                # Not started yet (pending allocation): srun cancels its request on SIGTERM.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                return self.wait(grace_s + 10)
            except subprocess.TimeoutExpired:
                self._kill_srun()
        self.proc.wait()
        return self.poll()


class SlurmLauncher(Launcher):
    name = "slurm"

    def __init__(self, mpi: str = "pmix", extra_args: list[str] = (), job_name: str = "gyre-fleet"):
        self.mpi = mpi
        self.extra_args = list(extra_args)
        self.job_name = job_name

    def command(self, plan: FleetPlan, argv: list[str]) -> list[str]:
        # --kill-on-bad-exit: one dead rank ends the step, so the supervisor sees it and relaunches
        # instead of the other ranks hanging in a collective. -v: srun logs each task exit it
        # gets, which is how SlurmHandle still knows the step's code when srun hangs after it.
        cmd = ["srun", "-v", f"--mpi={self.mpi}", "--kill-on-bad-exit=1", f"--job-name={self.job_name}",
               *self.extra_args]
        groups = plan.het_groups
        if groups is not None:
            return cmd + [f"--het-group={','.join(map(str, groups))}", *argv]
        if plan.packed:
            # Slurm gives each component of a het job nodes of its own, so a fleet of more cells
            # than nodes cannot be a het step; one step of world-size tasks in rank order (block
            # distribution: rank r is the r-th task) lets Slurm pack cells onto shared nodes.
            comp = plan.components[0]
            return cmd + ["--ntasks", str(plan.world_size), "--cpus-per-task", str(comp.cpus_per_task),
                          "--mem-per-cpu", f"{max(1, comp.mem_mb // comp.cpus_per_task)}M",
                          "--distribution=block", *argv]
        for i, comp in enumerate(plan.components):
            if i:
                cmd.append(":")
            block = ["--ntasks", str(comp.ntasks), "--cpus-per-task", str(comp.cpus_per_task)]
            if comp.mem_mb:
                block += ["--mem", f"{comp.mem_mb}M"]
            if comp.nodes:
                block += ["--nodes", str(len(comp.nodes)), "--nodelist", ",".join(comp.nodes)]
            else:
                block += ["--nodes", str(comp.nnodes)]
            cmd += block + list(argv)
        return cmd

    def launch(self, plan, argv, log_path=None, env=None, cwd=None) -> SlurmHandle:
        if shutil.which("srun") is None:
            raise LaunchError("srun not on PATH; install Slurm with `scripts/install-system.sh`")
        run_env = fleet_env(env)
        if plan.het_groups is None:
            # A het step in a plain allocation must not inherit the batch step's one-node shape.
            for var in ("SLURM_NTASKS", "SLURM_NPROCS", "SLURM_NNODES", "SLURM_CPUS_PER_TASK",
                        "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
                run_env.pop(var, None)
        hosts = functools.cache(node_hosts)   # one controller query a launch, and only if a decision needs it
        # The transports and the wait are the user's when set; otherwise chosen for the nodes.
        if "OMPI_MCA_btl" not in run_env and tcp_only(plan.packed, hosts):
            run_env["OMPI_MCA_btl"] = "self,tcp"
        if "OMPI_MCA_mpi_yield_when_idle" not in run_env and yield_when_idle(
                plan.world_size, hosts, socket.gethostname(), len(os.sched_getaffinity(0))):
            run_env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        command = self.command(plan, argv)
        offset = Path(log_path).stat().st_size if log_path is not None and Path(log_path).exists() else 0
        return SlurmHandle(_popen(command, log_path, run_env, cwd), command, log_path,
                           prefer_job=os.environ.get("SLURM_JOB_ID"), ntasks=plan.world_size, log_offset=offset)


def launcher_for(name: str, mpi: str = "pmix", extra_args: list[str] = ()) -> Launcher:
    if name == "local":
        return LocalLauncher()
    if name == "slurm":
        return SlurmLauncher(mpi=mpi, extra_args=extra_args)
    raise LaunchError(f"launcher {name!r} unknown; valid: local, slurm")

"""A real Slurm cluster on this one machine: munged, slurmctld and N virtual ``slurmd -N cN``.

Why a local cluster at all: the head job, het steps, ``scancel`` of one step and USR2
requeue are Slurm behaviours; the tests must exercise the real scheduler, not a fake.

Choices, each forced by something seen on this machine (Slurm 22.05, in a container):

- Every virtual node is ``NodeHostname=<host> NodeAddr=127.0.0.1`` with its own ``Port``, so
  N slurmd daemons share one host.
- ``TmpFS=<state>/tmp/%n``: PMIx steps spanning virtual nodes collide in one /tmp otherwise.
- ``SchedulerParameters=bf_interval=1``: heterogeneous jobs are started by the backfill
  scheduler only, which by default wakes every 30 s.
- ``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none``: no cgroups in a container.
- No accounting storage (``sacct`` fails); ``MinJobAge`` keeps finished jobs visible to
  ``squeue``/``scontrol`` so callers can poll those instead.
- Slurm's clients read ``/etc/slurm/slurm.conf`` unless ``SLURM_CONF`` is set, and every client
  (pytest, sbatch inside jobs, submitit) would need the variable; so ``up`` writes the file there
  too, marked as ours, and refuses to overwrite a slurm.conf that it did not write.
- Daemons run in the foreground (``-D``/``-F``) as our children in their own session, so the
  pid we record is the daemon's pid and ``down`` stops exactly those processes.

``up`` installs nothing: a missing binary is reported with the command that installs it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gyre_hpc import fsio

DEFAULT_STATE_DIR = "/tmp/gyre-cluster"
SYSTEM_CONF_DIR = Path("/etc/slurm")
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_RUN = Path("/run/munge")
CONF_MARKER = "# written by gyre-hpc cluster up"
INSTALL_HINT = "scripts/install-system.sh"
REQUIRED_BINARIES = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sinfo", "scontrol", "srun", "sbatch")


class ClusterError(RuntimeError):
    """The local cluster cannot be started or inspected; the message says why and what to do."""


@dataclass(frozen=True)
class ClusterSpec:
    """Shape of the local cluster. CPUs per node may exceed the real cores: oversubscription is fine for tests."""

    nodes: int = 4
    state_dir: Path = Path(DEFAULT_STATE_DIR)
    cpus_per_node: int = 4
    mem_per_node_mb: int = 2000
    ctld_port: int = 6817
    node_base_port: int = 17001
    partition: str = "debug"

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ClusterError(f"--nodes must be >= 1, got {self.nodes}")
        object.__setattr__(self, "state_dir", Path(self.state_dir).resolve())

    @property
    def node_names(self) -> list[str]:
        return [f"c{i}" for i in range(1, self.nodes + 1)]


@dataclass
class DaemonRecord:
    name: str
    pid: int
    argv: list[str]


@dataclass
class ClusterState:
    """What ``up`` started; persisted as ``pids.json`` so ``down`` stops only these."""

    nodes: int
    host: str
    daemons: list[DaemonRecord] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ClusterState":
        raw = json.loads(text)
        return cls(nodes=raw["nodes"], host=raw["host"], daemons=[DaemonRecord(**d) for d in raw["daemons"]])


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str
    cpus: int
    memory_mb: int


def state_dir_default() -> Path:
    return Path(os.environ.get("GYRE_CLUSTER_DIR", DEFAULT_STATE_DIR))


def missing_requirements() -> list[str]:
    """Binaries ``up`` needs that are not on PATH (including /usr/sbin, where Debian puts daemons)."""
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [b for b in REQUIRED_BINARIES if shutil.which(b, path=path) is None]


def _which(binary: str) -> str:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    found = shutil.which(binary, path=path)
    if found is None:
        raise ClusterError(f"{binary} not found; install the system packages with `{INSTALL_HINT}`")
    return found


def render_slurm_conf(spec: ClusterSpec, host: str) -> str:
    d = spec.state_dir
    lines = [
        CONF_MARKER + f" (state dir {d}); `gyre-hpc cluster down` stops its daemons",
        "ClusterName=gyre",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={spec.ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        # Also how long a requeued job waits before it may start again (default 120 s): the
        # USR2 -> requeue -> resume cycle should not idle for two minutes on a test cluster.
        "AuthInfo=cred_expire=20",
        "CredType=cred/munge",
        f"StateSaveLocation={d}/ctld",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/spool/%n/slurmd.pid",
        f"SlurmctldLogFile={d}/log/slurmctld.log",
        f"SlurmdLogFile={d}/log/slurmd-%n.log",
        f"TmpFS={d}/tmp/%n",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SwitchType=switch/none",
        "MpiDefault=pmix",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=bf_interval=1",
        "JobRequeue=1",
        "ReturnToService=2",
        "MinJobAge=600",
        "KillWait=5",
        # An srun killed outright leaves the allocation it created behind; reap those.
        "InactiveLimit=120",
        "SlurmdTimeout=300",
        "SlurmctldTimeout=120",
        "PropagateResourceLimits=NONE",
        # Nodes declare more CPUs than the machine has; without this slurmd reports the real
        # count and slurmctld drains every node as INVAL ("Low CPUs").
        "SlurmdParameters=config_overrides",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
    ]
    for i, name in enumerate(spec.node_names):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={spec.node_base_port + i} "
            f"CPUs={spec.cpus_per_node} RealMemory={spec.mem_per_node_mb} State=UNKNOWN")
    lines.append(f"PartitionName={spec.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def render_cgroup_conf() -> str:
    # Present so no plugin looks for a system cgroup.conf; nothing here uses cgroups.
    return CONF_MARKER + "\nCgroupPlugin=autodetect\nIgnoreSystemd=yes\n"


def pid_alive(rec: DaemonRecord) -> bool:
    """Alive AND still the program we started: a recycled pid must never be signalled."""
    try:
        cmdline = Path(f"/proc/{rec.pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{rec.pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    if ") Z " in stat or ") X " in stat:
        return False
    return bool(cmdline) and cmdline[0].decode(errors="replace") == rec.argv[0]


@contextlib.contextmanager
def _locked(state_dir: Path):
    """Engineers and CI jobs may call up/down concurrently; one at a time per state dir."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _read_state(state_dir: Path) -> ClusterState | None:
    p = state_dir / "pids.json"
    if not p.is_file():
        return None
    try:
        return ClusterState.from_json(p.read_text())
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ClusterError(f"{p} is corrupt ({exc}); stop its daemons by hand or remove the file") from None


def install_conf(name: str, text: str, conf_dir: Path = SYSTEM_CONF_DIR) -> Path:
    """Write a conf file where Slurm's clients look, never over a file some real cluster owns."""
    target = Path(conf_dir) / name
    if target.exists() and CONF_MARKER not in target.read_text(errors="replace"):
        raise ClusterError(
            f"{target} exists and was not written by gyre-hpc; refusing to overwrite a real cluster's "
            "config. Move it aside to use the local test cluster.")
    target.parent.mkdir(parents=True, exist_ok=True)
    fsio.write_text(target, text)
    return target


def _munge_works() -> bool:
    try:
        cred = subprocess.run([_which("munge"), "-n"], capture_output=True, timeout=5)
        if cred.returncode != 0:
            return False
        back = subprocess.run([_which("unmunge")], input=cred.stdout, capture_output=True, timeout=5)
        return back.returncode == 0
    except (subprocess.TimeoutExpired, ClusterError):
        return False


def _ensure_munge_key() -> None:
    munge_user = pwd.getpwnam("munge")
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        MUNGE_KEY.write_bytes(os.urandom(1024))
        os.chmod(MUNGE_KEY, 0o400)
        os.chown(MUNGE_KEY, munge_user.pw_uid, munge_user.pw_gid)
    MUNGE_RUN.mkdir(parents=True, exist_ok=True)
    os.chown(MUNGE_RUN, munge_user.pw_uid, munge_user.pw_gid)
    os.chmod(MUNGE_RUN, 0o755)


def _spawn(name: str, argv: list[str], log: Path, **kwargs) -> DaemonRecord:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True, **kwargs)
    return DaemonRecord(name=name, pid=proc.pid, argv=argv)


def node_states(timeout_s: float = 10.0) -> list[NodeState]:
    """Nodes as slurmctld sees them; raises ClusterError when no controller answers."""
    try:
        out = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%N|%T|%c|%m"],
                             capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterError("sinfo timed out: no slurmctld answers (`gyre-hpc cluster up`)") from None
    if out.returncode != 0:
        raise ClusterError(f"sinfo failed: {out.stderr.strip()} (`gyre-hpc cluster up`)")
    nodes = {}
    for line in out.stdout.splitlines():
        name, state, cpus, mem = line.split("|")
        nodes[name] = NodeState(name=name, state=state, cpus=int(cpus), memory_mb=int(mem))
    return [nodes[k] for k in sorted(nodes, key=lambda n: (len(n), n))]


# States of a node that can take (or is running) jobs; "idle" alone would make a second `up`
# wait for other people's jobs to end.
USABLE_STATES = frozenset({"idle", "mixed", "allocated", "completing"})


def _wait_idle(spec: ClusterSpec, timeout_s: float, usable: frozenset[str] = frozenset({"idle"})) -> list[NodeState]:
    deadline = time.monotonic() + timeout_s
    last: list[NodeState] | str = "no answer yet"
    while time.monotonic() < deadline:
        try:
            nodes = node_states(timeout_s=5)
            last = nodes
            if len(nodes) == spec.nodes and all(n.state in usable for n in nodes):
                return nodes
        except ClusterError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise ClusterError(f"nodes not {'/'.join(sorted(usable))} after {timeout_s:.0f} s: {last}; logs in {spec.state_dir / 'log'}")


@dataclass(frozen=True)
class UpResult:
    started: bool  # False: a cluster from this state dir was already running
    nodes: list[NodeState]
    state: ClusterState


def up(spec: ClusterSpec, wait_s: float = 60.0) -> UpResult:
    """Start the cluster, or report the one already running from this state dir (harmless twice)."""
    missing = missing_requirements()
    if missing:
        raise ClusterError(f"missing: {', '.join(missing)}; install with `{INSTALL_HINT}` (cluster up installs nothing)")
    if os.geteuid() != 0:
        raise ClusterError("cluster up runs slurmd/munged as root (they own /run/munge and switch users); run as root")
    with _locked(spec.state_dir):
        current = _read_state(spec.state_dir)
        if current is not None:
            alive = [d for d in current.daemons if pid_alive(d)]
            if alive and len(alive) == len(current.daemons):
                if current.nodes != spec.nodes:
                    raise ClusterError(
                        f"a cluster with {current.nodes} nodes is running from {spec.state_dir}; "
                        f"`gyre-hpc cluster down` first to start one with {spec.nodes}")
                running_conf = spec.state_dir / "slurm.conf"
                conf = render_slurm_conf(spec, current.host)
                if running_conf.is_file() and running_conf.read_text() != conf:
                    # Same nodes, other settings: apply them in place, running jobs keep running.
                    running_conf.write_text(conf)
                    install_conf("slurm.conf", conf)
                    out = subprocess.run([_which("scontrol"), "reconfigure"], capture_output=True, text=True,
                                         timeout=60)
                    if out.returncode != 0:
                        raise ClusterError(f"scontrol reconfigure failed: {out.stderr.strip()}")
                return UpResult(started=False, nodes=_wait_idle(spec, wait_s, USABLE_STATES), state=current)
            # Partly dead (a daemon crashed, the machine rebooted): stop the survivors, start afresh.
            _stop(current)
        return _start(spec, wait_s)


def _start(spec: ClusterSpec, wait_s: float) -> UpResult:
    host = socket.gethostname()
    d = spec.state_dir
    for sub in ("ctld", "log", *(f"spool/{n}" for n in spec.node_names), *(f"tmp/{n}" for n in spec.node_names)):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d / "tmp", 0o1777)
    conf = render_slurm_conf(spec, host)
    cgroup = render_cgroup_conf()
    (d / "slurm.conf").write_text(conf)
    (d / "cgroup.conf").write_text(cgroup)
    install_conf("slurm.conf", conf)
    install_conf("cgroup.conf", cgroup)

    state = ClusterState(nodes=spec.nodes, host=host)
    try:
        if not _munge_works():
            _ensure_munge_key()
            state.daemons.append(_spawn("munged", [_which("munged"), "-F"], d / "log" / "munged.out",
                                        user="munge", group="munge"))
            _wait_for(_munge_works, 15, "munged did not answer (munge -n | unmunge)", d)
        # -c: a fresh controller each up; a stale job table from an earlier cluster shape would
        # pin jobs to nodes that no longer exist.
        state.daemons.append(_spawn("slurmctld", [_which("slurmctld"), "-D", "-c"], d / "log" / "slurmctld.out"))
        for name in spec.node_names:
            state.daemons.append(_spawn(f"slurmd-{name}", [_which("slurmd"), "-D", "-N", name],
                                        d / "log" / f"slurmd-{name}.out"))
        fsio.write_text(d / "pids.json", state.to_json())
        nodes = _wait_idle(spec, wait_s)
    except BaseException:
        fsio.write_text(d / "pids.json", state.to_json())
        _stop(state)
        raise
    return UpResult(started=True, nodes=nodes, state=state)


def _wait_for(check, timeout_s: float, message: str, state_dir: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise ClusterError(f"{message}; logs in {state_dir / 'log'}")


def _stop(state: ClusterState, grace_s: float = 10.0) -> list[str]:
    """SIGTERM our daemons (slurmd first, munged last), then SIGKILL what outlives the grace."""
    order = sorted(state.daemons, key=lambda r: {"munged": 2, "slurmctld": 1}.get(r.name, 0))
    stopped = []
    for rec in order:
        if pid_alive(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGTERM)
            stopped.append(rec.name)
    deadline = time.monotonic() + grace_s
    for rec in order:
        while pid_alive(rec) and time.monotonic() < deadline:
            _reap(rec.pid)
            time.sleep(0.1)
        if pid_alive(rec):
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGKILL)
        _reap(rec.pid)
    return stopped


def _reap(pid: int) -> None:
    # Our own children (when up and down run in one process, as in tests) become zombies otherwise.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def down(state_dir: Path) -> list[str]:
    """Stop exactly the daemons ``up`` recorded; nothing running is not an error."""
    state_dir = Path(state_dir).resolve()
    if not (state_dir / "pids.json").exists():
        return []
    with _locked(state_dir):
        state = _read_state(state_dir)
        if state is None:
            return []
        stopped = _stop(state)
        (state_dir / "pids.json").unlink(missing_ok=True)
        return stopped


@dataclass(frozen=True)
class StatusReport:
    state_dir: Path
    daemons: list[tuple[DaemonRecord, bool]]
    nodes: list[NodeState]
    error: str | None


def status(state_dir: Path) -> StatusReport:
    state_dir = Path(state_dir).resolve()
    state = _read_state(state_dir)
    daemons = [(d, pid_alive(d)) for d in (state.daemons if state else [])]
    try:
        nodes, error = node_states(timeout_s=5), None
    except ClusterError as exc:
        nodes, error = [], str(exc)
    return StatusReport(state_dir=state_dir, daemons=daemons, nodes=nodes, error=error)

"""The local Slurm cluster: the conf it writes, idempotent up, harmless down."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gyre_hpc.jobs import cluster


def test_conf_gives_each_virtual_node_its_own_port_and_tmp(tmp_path):
    spec = cluster.ClusterSpec(nodes=3, state_dir=tmp_path)
    conf = cluster.render_slurm_conf(spec, host="box")
    node_lines = [l for l in conf.splitlines() if l.startswith("NodeName=")]
    assert [l.split()[0] for l in node_lines] == ["NodeName=c1", "NodeName=c2", "NodeName=c3"]
    ports = {l.split("Port=")[1].split()[0] for l in node_lines}
    assert len(ports) == 3
    assert all("NodeHostname=box NodeAddr=127.0.0.1" in l for l in node_lines)
    assert f"TmpFS={tmp_path}/tmp/%n" in conf
    assert "SchedulerParameters=bf_interval=1" in conf
    assert "MpiDefault=pmix" in conf
    assert "JobRequeue=1" in conf
    assert "SlurmdParameters=config_overrides" in conf
    assert conf.startswith(cluster.CONF_MARKER)


def test_spec_rejects_zero_nodes(tmp_path):
    with pytest.raises(cluster.ClusterError, match="--nodes must be >= 1"):
        cluster.ClusterSpec(nodes=0, state_dir=tmp_path)


def test_install_conf_refuses_a_foreign_slurm_conf(tmp_path):
    foreign = tmp_path / "slurm.conf"
    foreign.write_text("ClusterName=production\n")
    with pytest.raises(cluster.ClusterError, match="not written by gyre-hpc"):
        cluster.install_conf("slurm.conf", cluster.CONF_MARKER + "\nX=1\n", conf_dir=tmp_path)
    assert foreign.read_text() == "ClusterName=production\n"  # nothing already stored is lost
    ours = cluster.install_conf("cgroup.conf", cluster.render_cgroup_conf(), conf_dir=tmp_path)
    cluster.install_conf("cgroup.conf", cluster.render_cgroup_conf() + "# v2\n", conf_dir=tmp_path)
    assert ours.read_text().endswith("# v2\n")


def test_pid_alive_rejects_a_recycled_pid():
    me = cluster.DaemonRecord(name="x", pid=os.getpid(), argv=["/usr/sbin/slurmd"])
    assert not cluster.pid_alive(me)
    real_argv0 = open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\0")[0].decode()
    assert cluster.pid_alive(cluster.DaemonRecord(name="x", pid=os.getpid(), argv=[real_argv0]))


def test_down_with_nothing_running_is_harmless(tmp_path):
    assert cluster.down(tmp_path) == []
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()",
                          "cluster", "down", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "nothing was running" in out.stdout


def test_down_rejects_a_corrupt_pid_file(tmp_path):
    (tmp_path / "pids.json").write_text("{not json")
    with pytest.raises(cluster.ClusterError, match="pids.json is corrupt"):
        cluster.down(tmp_path)


def test_up_names_missing_binaries_and_the_install_script(tmp_path):
    env = dict(os.environ, PATH="/nonexistent")
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()",
                          "cluster", "up", "--dir", str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 1
    assert "sinfo" in out.stderr and "scripts/install-system.sh" in out.stderr
    assert not (tmp_path / "pids.json").exists()


@pytest.mark.slurm
def test_cluster_up_twice_is_harmless():
    nodes = cluster.node_states()
    state_dir = cluster.state_dir_default()
    before = (state_dir / "pids.json").read_text() if (state_dir / "pids.json").exists() else None
    if before is None:
        pytest.skip(f"the running cluster was not started from {state_dir} by `gyre-hpc cluster up`")
    result = cluster.up(cluster.ClusterSpec(nodes=len(nodes), state_dir=state_dir))
    assert result.started is False
    assert (state_dir / "pids.json").read_text() == before  # same daemons, none restarted
    assert [n.name for n in result.nodes] == [n.name for n in nodes]
    assert all(n.state in cluster.USABLE_STATES for n in result.nodes)
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()",
                          "cluster", "up", "--nodes", str(len(nodes))], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "already running" in out.stdout
    assert (state_dir / "pids.json").read_text() == before
    assert all(cluster.pid_alive(d) for d in cluster.ClusterState.from_json(before).daemons)


@pytest.mark.slurm
def test_up_with_another_node_count_says_to_stop_first():
    state_dir = cluster.state_dir_default()
    if not (state_dir / "pids.json").exists():
        pytest.skip(f"the running cluster was not started from {state_dir} by `gyre-hpc cluster up`")
    n = len(cluster.node_states())
    with pytest.raises(cluster.ClusterError, match="cluster down` first"):
        cluster.up(cluster.ClusterSpec(nodes=n + 1, state_dir=state_dir))


@pytest.mark.slurm
def test_status_lists_our_daemons_and_every_node():
    state_dir = cluster.state_dir_default()
    if not (state_dir / "pids.json").exists():
        pytest.skip(f"the running cluster was not started from {state_dir} by `gyre-hpc cluster up`")
    out = subprocess.run([sys.executable, "-c", "from gyre_hpc.cli import main; main()", "cluster", "status"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "slurmctld" in out.stdout and "gone" not in out.stdout
    for node in cluster.node_states():
        assert f"{node.name} " in out.stdout


def _wait_until_execed(pid: int, program: str, timeout_s: float = 10.0) -> None:
    """Popen returns once exec has closed the child's close-on-exec pipe, which the kernel does
    before it fills in the new argv: for a moment /proc/<pid>/cmdline reads empty (CI on a loaded
    host caught that moment, and down rightly refused an unrecognised pid). Waits until ``down``'s
    own check (``cluster.pid_alive``) recognises the program."""
    deadline = time.monotonic() + timeout_s
    while not cluster.pid_alive(cluster.DaemonRecord("probe", pid, [program])):
        assert time.monotonic() < deadline, f"pid {pid} never showed {program!r} in its cmdline"
        time.sleep(0.01)


def test_down_stops_exactly_the_recorded_daemons(tmp_path):
    """Real processes stand in for daemons: down signals the recorded one, never a pid whose
    program changed (a recycled pid), and forgets the cluster."""
    ours = subprocess.Popen(["sleep", "300"])
    stranger = subprocess.Popen(["sleep", "301"])
    try:
        for p in (ours, stranger):
            _wait_until_execed(p.pid, "sleep")
        state = cluster.ClusterState(nodes=1, host="box", daemons=[
            cluster.DaemonRecord("slurmd-c1", ours.pid, ["sleep", "300"]),
            # recorded as slurmctld, but that pid now runs something else
            cluster.DaemonRecord("slurmctld", stranger.pid, ["/usr/sbin/slurmctld", "-D"]),
        ])
        (tmp_path / "pids.json").write_text(state.to_json())
        assert cluster.down(tmp_path) == ["slurmd-c1"]
        ours.wait(timeout=15)  # down reaped it already (its own child here): just gone
        assert not os.path.exists(f"/proc/{ours.pid}")
        assert stranger.poll() is None
        assert not (tmp_path / "pids.json").exists()
        assert cluster.down(tmp_path) == []
    finally:
        for p in (ours, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()

"""``gyre-hpc cluster up|down|status``: the local Slurm cluster the tests and examples run on."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from gyre_hpc.jobs import cluster as _cluster

_dir_option = click.option(
    "--dir", "state_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="state dir for conf, logs and pids (default $GYRE_CLUSTER_DIR or /tmp/gyre-cluster)")


@click.group()
def cluster() -> None:
    """Start, stop and inspect a Slurm cluster of virtual nodes on this machine."""


@cluster.command()
@click.option("--nodes", type=int, default=4, show_default=True, help="virtual nodes (slurmd -N cN)")
@click.option("--cpus-per-node", type=int, default=4, show_default=True)
@click.option("--wait", "wait_s", type=float, default=60.0, show_default=True, help="seconds to wait for idle nodes")
@_dir_option
def up(nodes: int, cpus_per_node: int, wait_s: float, state_dir: Path | None) -> None:
    """Start munged, slurmctld and N slurmd; harmless when already running."""
    try:
        spec = _cluster.ClusterSpec(nodes=nodes, cpus_per_node=cpus_per_node,
                                    state_dir=state_dir or _cluster.state_dir_default())
        result = _cluster.up(spec, wait_s=wait_s)
    except _cluster.ClusterError as exc:
        click.echo(f"cluster up: {exc}", err=True)
        sys.exit(1)
    verb = "started" if result.started else "already running"
    click.echo(f"cluster {verb}: {len(result.nodes)} nodes up ({spec.state_dir})")
    _print_nodes(result.nodes)


@cluster.command()
@_dir_option
def down(state_dir: Path | None) -> None:
    """Stop the daemons `up` started (by pid); nothing running is fine."""
    d = state_dir or _cluster.state_dir_default()
    try:
        stopped = _cluster.down(d)
    except _cluster.ClusterError as exc:
        click.echo(f"cluster down: {exc}", err=True)
        sys.exit(1)
    click.echo(f"cluster down: stopped {', '.join(stopped)}" if stopped else "cluster down: nothing was running")


@cluster.command()
@_dir_option
def status(state_dir: Path | None) -> None:
    """Print our daemons and the nodes slurmctld reports."""
    try:
        report = _cluster.status(state_dir or _cluster.state_dir_default())
    except _cluster.ClusterError as exc:
        click.echo(f"cluster status: {exc}", err=True)
        sys.exit(1)
    click.echo(f"state dir: {report.state_dir}")
    if not report.daemons:
        click.echo("daemons: none recorded (not started by `gyre-hpc cluster up` from this dir)")
    for rec, alive in report.daemons:
        click.echo(f"  {rec.name:<12} pid {rec.pid:<8} {'running' if alive else 'gone'}")
    if report.error:
        click.echo(f"nodes: {report.error}")
        sys.exit(1)
    _print_nodes(report.nodes)


def _print_nodes(nodes) -> None:
    for n in nodes:
        click.echo(f"  {n.name:<6} {n.state:<10} cpus={n.cpus} mem={n.memory_mb}MB")

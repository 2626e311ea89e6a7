"""Benchmarks that print JSON figures beside a baseline measured in the same run.

Each benchmark is a module here exposing a click command named ``command``; the group
loads it only when asked so one benchmark's imports never slow another.
"""
from __future__ import annotations

import click

from gyre_hpc.cli import LazyGroup
from gyre_hpc.report import emit  # noqa: F401  (the benchmarks print through it)

BENCHMARKS = {
    "switch": "gyre_hpc.bench.switch:command",
    "trees": "gyre_hpc.bench.trees:command",
    "store": "gyre_hpc.bench.store:command",
    "migrate": "gyre_hpc.bench.migrate:command",
    "e2e": "gyre_hpc.bench.e2e:command",
    "engines": "gyre_hpc.bench.engines:command",
    "scale": "gyre_hpc.bench.scale:command",
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench() -> None:
    """Measure a part against its baseline, in one run; `--json` for machine-readable output."""

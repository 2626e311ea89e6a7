"""Benchmarks that print JSON figures beside a baseline measured in the same run.

Each benchmark is a module here exposing a click command named ``command``; the group
loads it only when asked so one benchmark's imports never slow another.
"""
from __future__ import annotations

import json
import sys

import click

from gyre_hpc.cli import LazyGroup

BENCHMARKS = {
    "switch": "gyre_hpc.bench.switch:command",
    "trees": "gyre_hpc.bench.trees:command",
    "store": "gyre_hpc.bench.store:command",
    "migrate": "gyre_hpc.bench.migrate:command",
    "e2e": "gyre_hpc.bench.e2e:command",
    "scale": "gyre_hpc.bench.scale:command",
}


@click.group(cls=LazyGroup, lazy=BENCHMARKS)
def bench() -> None:
    """Measure a part against its baseline, in one run; `--json` for machine-readable output."""


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark's figures: JSON for tools, an indented listing for people."""
    if as_json:
        json.dump(result, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
        return
    def walk(d, indent=0):
        for k, v in d.items():
            if isinstance(v, dict):
                click.echo(" " * indent + f"{k}:")
                walk(v, indent + 2)
            else:
                click.echo(" " * indent + f"{k}: {v}")
    walk(result)

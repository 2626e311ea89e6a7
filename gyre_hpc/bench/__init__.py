"""Benchmarks that print JSON figures beside a baseline measured in the same run.

Each benchmark is a module here exposing a click command named ``command``; the ``gyre-hpc
bench`` group (``cli.bench``, built from ``BENCHMARKS``: this package never imports the command
line above it) loads it only when asked so one benchmark's imports never slow another.
"""
from __future__ import annotations

BENCHMARKS = {
    "switch": "gyre_hpc.bench.switch:command",
    "trees": "gyre_hpc.bench.trees:command",
    "store": "gyre_hpc.bench.store:command",
    "migrate": "gyre_hpc.bench.migrate:command",
    "e2e": "gyre_hpc.bench.e2e:command",
    "engines": "gyre_hpc.bench.engines:command",
    "scale": "gyre_hpc.bench.scale:command",
    "xlong": "gyre_hpc.bench.xlong:command",
    "fuzz": "gyre_hpc.bench.fuzz:command",
    "load": "gyre_hpc.bench.load:command",
    "chaos": "gyre_hpc.bench.chaos:command",
}


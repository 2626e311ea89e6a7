"""Helpers for the fleet tests: launch real MPI ranks: ``mpiexec -n N --oversubscribe`` in a subprocess.

Each test runs a rank program from ``ranks/`` (or the fleet entry itself) and reads what
rank 0 wrote; a timeout turns a hang into a failure instead of a stuck suite.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

RANKS = Path(__file__).parent / "ranks"


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", GYRE_TORCH_THREADS="1")
    return env


def mpiexec(n: int, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["mpiexec", "-n", str(n), "--oversubscribe", sys.executable, *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s (hang?)\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}")


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def make_run_dir(root: Path, **sections) -> Path:
    """A run dir with a config.yaml: the substrate on 3 single-rank cells unless overridden."""
    cfg = {"name": "cells-test", "cells": {"count": 3, "ranks_per_cell": 1, "core": 0},
           "scheduler": {"policy": "scripted"}, "model": {"substrate_state_mb": 2},
           "train": {"steps": 4}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(yaml.safe_dump(cfg))
    return root

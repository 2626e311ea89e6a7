"""Helpers for the RL tests: write a run dir, run the fleet under mpiexec, read results."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gyre_hpc.cells import checkpoint
from gyre_hpc.config import RunConfig, build_config
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.trees.store import TreeStore

REPO = Path(__file__).resolve().parents[2]
PROGRAM = str(Path(__file__).with_name("fleet_program.py"))

# Small and fast: the easy suite (one model call per run), short outputs.
BASE = {"workload": "rl", "seed": 0,
        "rollout": {"tasks": "easy", "runs_per_task": 4, "tasks_per_step": 2, "max_new_tokens": 24},
        "train": {"steps": 2, "lr": 0.02},
        "supervise": {"poll_s": 0.2}}


def rl_config(tmp_path: Path, *overrides: str, **sections) -> RunConfig:
    data = json.loads(json.dumps(BASE))
    data["run_dir"] = str(tmp_path / "run")
    for k, v in sections.items():
        data.setdefault(k, {}).update(v) if isinstance(v, dict) else data.__setitem__(k, v)
    return build_config(data, list(overrides))


def write_run_dir(cfg: RunConfig) -> RunDir:
    run = RunDir.at(cfg.run_dir).make()
    run.config.write_text(cfg.to_yaml())
    return run


def program_argv(run: RunDir, policy: str = "config", verify: bool = True) -> list[str]:
    argv = [sys.executable, PROGRAM, str(run.root), "--policy", policy, "--result", str(run.logs / "result.json")]
    return argv + (["--verify"] if verify else [])


def mpi_env() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", GYRE_TORCH_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_fleet(cfg: RunConfig, policy: str = "config", timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    run = write_run_dir(cfg)
    n = 1 + cfg.cells.count * cfg.cells.ranks_per_cell
    proc = subprocess.run(["mpiexec", "--oversubscribe", "-n", str(n), *program_argv(run, policy)],
                          capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=REPO)
    result_file = run.logs / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else {}
    return proc, result


def store_run_ids(run: RunDir) -> list[str]:
    with TreeStore.open(run.trees, "r") as store:
        return store.run_ids()


def latest_meta(run: RunDir) -> checkpoint.CheckpointMeta | None:
    latest = checkpoint.latest_dir(run.checkpoints)
    return None if latest is None else checkpoint.read_meta(latest)

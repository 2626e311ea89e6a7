"""The head's check of a config before any rank starts, by workload.

Each workload's check lives with the workload (``rl.preflight``: task suites, model presets,
the warm-start checkpoint) and ``config.WORKLOADS`` names it as a command line, as it names
the fleet's: ``jobs`` sits below the workloads and imports none of them, so the head runs the
check as a process (``python -m gyre_hpc.rl.preflight CONFIG --result FILE``). A workload
without one has nothing to check beyond config.py's own validation.

The process reads the resolved config from a file and writes ``{"config": YAML}`` or
``{"error": MESSAGE}`` (a ConfigError naming the field) to the result file; everything it
prints is passed to ``log`` line by line (a warm-start build's progress).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from gyre_hpc.config import WORKLOADS, ConfigError, RunConfig, build_config, load_yaml


def _run_preflight(cfg: RunConfig, prepare: str | None, log: Callable[[str], None]) -> RunConfig:
    argv = WORKLOADS[cfg.workload].preflight
    if argv is None:
        return cfg
    with tempfile.TemporaryDirectory(prefix="gyre-preflight-") as tmp:
        config, result = Path(tmp) / "config.yaml", Path(tmp) / "result.json"
        config.write_text(cfg.to_yaml())
        cmd = [sys.executable, *argv, str(config), "--result", str(result)]
        if prepare is not None:
            cmd += ["--prepare", prepare]
        with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) as proc:
            for line in proc.stdout:
                log(line.rstrip("\n"))
        try:
            answer = json.loads(result.read_text())
        except (OSError, ValueError):
            raise RuntimeError(f"the {cfg.workload} preflight ({' '.join(cmd[1:3])}) exited {proc.returncode} "
                               f"without an answer; its output is above") from None
    if "error" in answer:
        raise ConfigError(answer["error"])
    return build_config(load_yaml(answer["config"]), source=f"the {cfg.workload} preflight")


def check_workload_config(cfg: RunConfig, log: Callable[[str], None] = print) -> None:
    """ConfigError naming the field when the workload cannot run this config."""
    _run_preflight(cfg, None, log)


def prepare_workload_config(cfg: RunConfig, build: bool, log: Callable[[str], None] = print) -> RunConfig:
    """The config the fleet runs: ``cfg`` checked, with what its workload resolves before launch.

    ``build=False`` on a login node (``submit``): nothing is trained there, a missing artefact
    is a ConfigError naming what to build."""
    return _run_preflight(cfg, "build" if build else "lookup", log)

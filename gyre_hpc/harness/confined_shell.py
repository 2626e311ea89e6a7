"""The confined shell an outside scaffold calls to run a command for the model.

A scaffold (``rollout.agent: {command: ...}``) is the user's own code and runs on the host, in
the run's workspace; what it executes on the model's behalf must not. It runs

    $GYRE_SHELL -c 'pytest -q'            (or: python -m gyre_hpc.harness.confined_shell -c ...)

and gets the command's output on stdout and its exit status, the command having run in this
project's jail (``confine.run_confined``: namespaces, read-only host root, the workspace as its
only writable place, rlimits, scrubbed environment) with the run's command limits. The runner
(``harness.scaffold``) puts the workspace, the limits and the run's deadline in the scaffold's
environment (``shell_env``); the shell reads them back (``shell_settings``), so a command can
never outlive the run's wall clock.

Exit status: the command's own; ``TIMEOUT_EXIT`` (124, as coreutils ``timeout``) when its
wall clock killed it; ``KILLED_EXIT`` (137) when it was killed for flooding its output or the
workspace quota; ``USAGE_EXIT`` (2) for a bad call or settings, with the reason on stderr.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness.confine import CommandResult, Limits, run_confined

ENV_WORKSPACE = "GYRE_WORKSPACE"
ENV_LIMITS = "GYRE_SHELL_LIMITS"
ENV_DEADLINE = "GYRE_DEADLINE"      # the run's end, seconds since the epoch (a wall clock the child shares)
ENV_SHELL = "GYRE_SHELL"            # how to call this shell: a command line (shlex-quoted)
TIMEOUT_EXIT, KILLED_EXIT, USAGE_EXIT = 124, 137, 2


@dataclass(frozen=True)
class ShellSettings:
    workspace: Path
    limits: Limits
    deadline: float | None      # epoch seconds


def shell_command() -> str:
    """The command line that runs this shell with the interpreter running now."""
    return f"{shlex.quote(sys.executable)} -m gyre_hpc.harness.confined_shell"


def shell_env(workspace: str | Path, limits: Limits, deadline: float | None) -> dict[str, str]:
    """What a scaffold's environment carries for the shell (``GYRE_SHELL`` included)."""
    fields = {f.name: getattr(limits, f.name) for f in dataclasses.fields(Limits)}
    fields["host_paths"] = list(fields["host_paths"])
    env = {ENV_WORKSPACE: str(Path(workspace).resolve()), ENV_LIMITS: json.dumps(fields), ENV_SHELL: shell_command()}
    if deadline is not None:
        env[ENV_DEADLINE] = repr(float(deadline))
    return env


def shell_settings(env) -> ShellSettings:
    """The settings ``shell_env`` wrote; ValueError naming the variable that is missing or bad."""
    if not env.get(ENV_WORKSPACE):
        raise ValueError(f"{ENV_WORKSPACE} is not set: the run's workspace (the scaffold's runner sets it)")
    workspace = Path(env[ENV_WORKSPACE])
    if not workspace.is_dir():
        raise ValueError(f"{ENV_WORKSPACE}={workspace} is not a directory")
    try:
        raw = json.loads(env.get(ENV_LIMITS) or "{}")
        if "host_paths" in raw:
            raw["host_paths"] = tuple(raw["host_paths"])
        limits = Limits(**raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{ENV_LIMITS} is not a Limits object as JSON: {exc}") from None
    deadline = None
    if env.get(ENV_DEADLINE):
        try:
            deadline = float(env[ENV_DEADLINE])
        except ValueError:
            raise ValueError(f"{ENV_DEADLINE}={env[ENV_DEADLINE]!r} is not a number of seconds") from None
    return ShellSettings(workspace, limits, deadline)


def exit_status(result: CommandResult) -> int:
    if result.timed_out:
        return TIMEOUT_EXIT
    return KILLED_EXIT if result.returncode is None else result.returncode


def run(command: str, settings: ShellSettings, stdin: bytes | None = None) -> CommandResult:
    """``command`` in the jail, its wall clock cut to what is left of the run's."""
    limits = settings.limits
    if settings.deadline is not None:
        left = settings.deadline - time.time()
        if left <= 0:
            return CommandResult(None, b"[not run: the run's wall clock has run out]\n", True, False, 0.0)
        limits = dataclasses.replace(limits, wall_s=min(limits.wall_s, left))
    return run_confined(command, settings.workspace, limits, stdin=stdin)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre-shell", description="Run a command in the run's jail.")
    parser.add_argument("-c", dest="command", required=True, help="the command, as sh -c takes it")
    args = parser.parse_args(argv)
    try:
        settings = shell_settings(os.environ)
    except ValueError as exc:
        print(f"gyre-shell: {exc}", file=sys.stderr)
        return USAGE_EXIT
    # No stdin: a scaffold's pipe that is never closed would hang the call.
    result = run(args.command, settings)
    sys.stdout.buffer.write(result.output)
    if result.truncated:
        sys.stdout.buffer.write(b"\n[output truncated]\n")
    if result.timed_out:
        sys.stdout.buffer.write(b"\n[killed: wall-clock timeout]\n")
    sys.stdout.flush()
    return exit_status(result)


if __name__ == "__main__":
    sys.exit(main())

"""One run of an outside agent scaffold: the user's command, driven through the endpoint.

``rollout.agent: {command: [...]}`` (or ``mini-swe-agent``, which is such a command: see
``harness.mini_swe``). Per run:

1. the task's files into the run's workspace, a session opened on the endpoint (its own key,
   its journal at the run's journal path, the task's turn budget, the run's deadline);
2. the command started in the workspace, in a process group of its own, with
   ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the session's key), the task in
   ``GYRE_TASK_PROMPT``/``GYRE_TASK_ID``/``GYRE_TURN_BUDGET``, and the confined shell's
   settings (``confined_shell.shell_env``; ``GYRE_SHELL`` is how to call it);
3. the budgets enforced from outside: the run's wall clock (``rollout.run_timeout_s``) and the
   turn budget (the session refuses the call past it) each kill the whole process group;
4. the task's tests on the final workspace (whatever ended the run: partial progress counts,
   as for the harness's own runs), the journal ended with the score.

The result is a ``loop.RunResult`` whose calls are the journal's: a scaffold's run builds into
a tree exactly as a harness run does. Status: ``finished`` (the scaffold exited 0, or its turn
budget was spent), ``timeout`` (the wall clock), ``failed`` (it exited otherwise; the log's
tail is the error). A run cannot be replayed (the scaffold's state is its own), so an
unfinished journal restarts the run from scratch; a finished one is its result.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gyre_hpc.harness.client import ModelClient
from gyre_hpc.harness.confined_shell import shell_env
from gyre_hpc.harness.journal import load_journal
from gyre_hpc.harness.loop import HarnessConfig, RunResult
from gyre_hpc.harness.tasks import Task, score_workspace

if TYPE_CHECKING:     # FastAPI and uvicorn (the endpoint extra) only where a scaffold is served
    from gyre_hpc.harness.endpoint_server import EndpointServer

LOG_TAIL_BYTES = 2000


def mini_swe_command() -> list[str]:
    """``rollout.agent: mini-swe-agent``: its DefaultAgent over this project's confined
    environment (``harness.mini_swe``), run with the interpreter running now."""
    return [sys.executable, "-m", "gyre_hpc.harness.mini_swe"]


def scaffold_env(base: Mapping[str, str], *, url: str, key: str, task: Task, workspace: Path,
                 cfg: HarnessConfig, deadline_epoch: float, model_name: str) -> dict[str, str]:
    """The scaffold's environment: ``base`` (the controller's) with any OpenAI settings replaced."""
    env = {k: v for k, v in base.items() if not k.startswith("OPENAI_")}
    env.update(OPENAI_BASE_URL=url, OPENAI_API_KEY=key, GYRE_MODEL=model_name, GYRE_TASK_ID=task.task_id,
               GYRE_TASK_PROMPT=task.spec, GYRE_TURN_BUDGET=str(task.max_turns), GYRE_ANSWER_FILE=task.answer_file)
    env.update(shell_env(workspace, cfg.command_limits, deadline_epoch))
    return env


class ScaffoldRun:
    """One run; ``await ScaffoldRun(...).run()``. Not reusable."""

    def __init__(self, task: Task, workspace: str | Path, client: ModelClient, journal_path: str | Path,
                 cfg: HarnessConfig, endpoint: "EndpointServer", command: Sequence[str], run_id: str = "run",
                 log_path: str | Path | None = None, env: Mapping[str, str] | None = None) -> None:
        if not command:
            raise ValueError("ScaffoldRun: command is empty (rollout.agent.command needs a program)")
        self.task, self.client, self.cfg, self.endpoint, self.run_id = task, client, cfg, endpoint, run_id
        self.command = [str(c) for c in command]
        self.workspace_path, self.journal_path = Path(workspace), Path(journal_path)
        self.log_path = Path(log_path) if log_path else self.journal_path.with_suffix(".scaffold.log")
        self.base_env = dict(os.environ if env is None else env)
        self.session = None

    async def run(self, resume: bool = True) -> RunResult:
        restarted = False     # an unfinished journal with calls: counted as begun again at call 0
        if self.journal_path.exists():
            state = load_journal(self.journal_path)
            if resume and state.finished:
                return RunResult(self.run_id, self.task.task_id, state.status, state.reward or 0.0,
                                 state.wall_s or 0.0, state.calls, None)
            # Unfinished: the scaffold's own state is gone, so the run starts over; the journal
            # shows the workspace is this run's.
            restarted = len(state.calls) > 0
            self.journal_path.unlink()
            shutil.rmtree(self.workspace_path, ignore_errors=True)
        elif self.workspace_path.exists() and any(self.workspace_path.iterdir()):
            raise FileExistsError(f"workspace {self.workspace_path} is not empty and has no journal at "
                                  f"{self.journal_path}: refusing to overwrite files this run did not create")
        self.task.materialize(self.workspace_path)
        start = time.monotonic()
        deadline = start + self.cfg.run_timeout_s
        session = self.session = self.endpoint.registry.open(
            self.run_id, self.client, self.journal_path, self.task.task_id, max_calls=self.task.max_turns,
            deadline=deadline)
        env = scaffold_env(self.base_env, url=self.endpoint.url, key=session.key, task=self.task,
                           workspace=self.workspace_path, cfg=self.cfg, deadline_epoch=time.time() + self.cfg.run_timeout_s,
                           model_name=self.endpoint.model_name)
        status, error = "finished", None
        try:
            status, error = await self._drive(env, session, deadline)
        finally:
            async with session.lock:        # a call in flight ends (at the deadline at the latest) first
                session.closed = True
            self.endpoint.registry.close(session.key)
        check, crash = await asyncio.to_thread(score_workspace, self.task, self.workspace_path, self.cfg.check_limits)
        if crash:
            status, error = "failed", f"{error}; {crash}" if error else crash
        wall = time.monotonic() - start
        session.journal.end(status, check.score, wall, list(check.passed))
        return RunResult(self.run_id, self.task.task_id, status, check.score, wall, session.journal.log, check,
                         error=error, restarted=restarted)

    async def _drive(self, env: dict[str, str], session, deadline: float) -> tuple[str, str | None]:
        """Run the scaffold to its end or its budget's; (status, error)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                *self.command, cwd=str(self.workspace_path), env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        exited = asyncio.ensure_future(proc.wait())
        spent = asyncio.ensure_future(session.spent.wait())
        try:
            done, _ = await asyncio.wait({exited, spent}, timeout=max(deadline - time.monotonic(), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            spent.cancel()
            if proc.returncode is None:
                _kill_group(proc.pid)
            await exited                     # reaped: no zombie, the group's leader is gone
            _kill_group(proc.pid)            # and whatever it left in its group
        if exited in done and not session.spent.is_set():
            if proc.returncode == 0:
                return "finished", None
            return "failed", f"scaffold exited {proc.returncode}: {self._log_tail()}"
        if session.spent.is_set():
            return "finished", None          # the turn budget: as the harness's "turns spent"
        return "timeout", None

    def _log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-LOG_TAIL_BYTES:]
        except OSError:
            return ""
        return data.decode("utf-8", errors="replace").strip()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


"""mini-swe-agent as a run's scaffold (``rollout.agent: mini-swe-agent``), its commands confined.

mini-swe-agent (PyPI ``mini-swe-agent``, the ``miniswe`` extra) is a real software-engineering
agent: a loop of model calls, each reply carrying one bash command, each command's output the
next user turn. It is used unmodified; what this project ships is

- ``ConfinedEnvironment``: an environment in mini-swe-agent's sense (``execute(action, cwd,
  timeout) -> {output, returncode, exception_info}``, ``get_template_vars``, ``serialize``)
  whose commands run in this project's jail (``confined_shell.run``: the run's workspace is the
  jail's only writable place, the host is not reachable), never on the host. A command whose
  output starts with mini-swe-agent's submit line ends the agent, as its own environments do;
- ``main``: the process ``harness.scaffold.ScaffoldRun`` starts per run: mini-swe-agent's
  ``DefaultAgent`` with its text-based litellm model pointed at the run's session
  (``openai/<model>`` at ``OPENAI_BASE_URL`` with ``OPENAI_API_KEY``: litellm's route to any
  OpenAI-compatible server), on ``GYRE_TASK_PROMPT``.

Why templates of our own by default: mini-swe-agent's shipped prompts are ~1,500 tokens, more
than a tiny policy's whole context; ``--config FILE`` takes a mini-swe-agent config (its
``agent`` and ``model`` sections, e.g. its own ``mini_textbased.yaml``) instead. The turn budget
and wall clock are the runner's (the session refuses the call past the budget and the runner
kills the process group); mini-swe-agent's own step limit is set to the same budget so it ends
cleanly when it can, and its format-error limit is off (a malformed reply costs a turn, as in
the harness).
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from gyre_hpc.harness.confined_shell import ShellSettings, exit_status, run, shell_settings

SUBMIT_LINE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"   # mini-swe-agent's protocol for "done"
ACTION_FENCE = "mswea_bash_command"                      # its text-based model's action block

SYSTEM_TEMPLATE = (f"Reply with one shell command in a ```{ACTION_FENCE} block. When done, run: echo {SUBMIT_LINE}")
INSTANCE_TEMPLATE = "{{task}}"
OBSERVATION_TEMPLATE = "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
FORMAT_ERROR_TEMPLATE = f"Reply with exactly one ```{ACTION_FENCE} block."


class ConfinedEnvironment:
    """mini-swe-agent's environment interface over ``confined_shell`` (one jail per command)."""

    def __init__(self, settings: ShellSettings | None = None, *, timeout: float | None = None, **kwargs) -> None:
        from pydantic import BaseModel

        class Config(BaseModel):
            cwd: str = ""
            timeout: float | None = None

        self.settings = settings or shell_settings(os.environ)
        self.config = Config(timeout=timeout, **kwargs)

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict:
        command = action.get("command", "") if isinstance(action, dict) else str(action)
        where = cwd or self.config.cwd
        if where:
            command = f"cd {shlex.quote(where)} && {command}"
        settings = self.settings
        limit = timeout or self.config.timeout
        if limit:
            settings = replace(settings, limits=replace(settings.limits, wall_s=min(settings.limits.wall_s, limit)))
        try:
            result = run(command, settings)
        except Exception as exc:  # noqa: BLE001 - the agent sees why, as mini-swe-agent's own environments report it
            return {"output": "", "returncode": -1, "exception_info": f"{type(exc).__name__}: {exc}"}
        text = result.output.decode("utf-8", errors="replace")
        info = "the command was killed by its wall clock" if result.timed_out else ""
        output = {"output": text, "returncode": exit_status(result), "exception_info": info}
        self._submit_if_done(output)
        return output

    def _submit_if_done(self, output: dict) -> None:
        first, _, rest = output["output"].lstrip().partition("\n")
        if first.strip() == SUBMIT_LINE and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted
            raise Submitted({"role": "exit", "content": rest,
                             "extra": {"exit_status": "Submitted", "submission": rest}})

    def get_template_vars(self, **kwargs) -> dict:
        # Not os.environ (mini-swe-agent's local environment passes it): it holds the session key.
        return {**self.config.model_dump(), **platform.uname()._asdict(), "cwd": "/tmp/workspace", **kwargs}

    def serialize(self) -> dict:
        return {"info": {"config": {"environment": self.config.model_dump(mode="json"),
                                    "environment_type": f"{type(self).__module__}.{type(self).__name__}"}}}


def agent_settings(config_file: str | None, turn_budget: int) -> tuple[dict, dict]:
    """(agent keyword arguments, model config) for ``DefaultAgent`` and its text-based model."""
    agent = {"system_template": SYSTEM_TEMPLATE, "instance_template": INSTANCE_TEMPLATE,
             "max_consecutive_format_errors": 0}
    model = {"observation_template": OBSERVATION_TEMPLATE, "format_error_template": FORMAT_ERROR_TEMPLATE}
    if config_file:
        import yaml
        data = yaml.safe_load(Path(config_file).read_text()) or {}
        agent = {**agent, **(data.get("agent") or {})}
        model = {**model, **{k: v for k, v in (data.get("model") or {}).items() if k != "model_name"}}
    agent.update(step_limit=turn_budget, cost_limit=0.0)
    return agent, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gyre-mini-swe", description="mini-swe-agent on one run's session.")
    parser.add_argument("--config", default=None, help="a mini-swe-agent config (agent, model sections)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")   # a refused call is the run's end
    # litellm fetches its cost map from GitHub at import (three tries, ~10 s where the fleet
    # has no network); the copy it ships is all a cost nobody pays needs.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    agent_kw, model_kw = agent_settings(args.config, int(os.environ["GYRE_TURN_BUDGET"]))
    model = LitellmTextbasedModel(model_name=f"openai/{os.environ.get('GYRE_MODEL', 'policy')}",
                                  model_kwargs={"api_base": os.environ["OPENAI_BASE_URL"],
                                                "api_key": os.environ["OPENAI_API_KEY"]},
                                  cost_tracking="ignore_errors", **model_kw)
    agent = DefaultAgent(model, ConfinedEnvironment(), **agent_kw)
    result = agent.run(os.environ["GYRE_TASK_PROMPT"])
    print(f"mini-swe-agent: {result.get('exit_status')} after {agent.n_calls} model calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

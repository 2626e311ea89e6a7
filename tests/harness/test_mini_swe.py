"""mini-swe-agent, unmodified, as a run's scaffold (``rollout.agent: mini-swe-agent``): its
litellm model through the endpoint, its commands through ``harness.mini_swe.ConfinedEnvironment``
(the jail), the run scored by the task's tests."""
from __future__ import annotations

import asyncio
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("uvicorn", reason="uvicorn is not installed (the endpoint extra)")

from gyre_hpc.engines.torch_engine import TorchEngine  # noqa: E402
from gyre_hpc.harness.chat_render import ChatRenderer  # noqa: E402
from gyre_hpc.harness.client import Completion  # noqa: E402
from gyre_hpc.harness.confine import Limits, isolation_mode  # noqa: E402
from gyre_hpc.harness.confined_shell import ShellSettings  # noqa: E402
from gyre_hpc.harness.endpoint_server import EndpointServer  # noqa: E402
from gyre_hpc.harness.engine_client import EngineCalls  # noqa: E402
from gyre_hpc.harness.journal import load_journal  # noqa: E402
from gyre_hpc.harness.loop import HarnessConfig  # noqa: E402
from gyre_hpc.harness.mini_swe import SUBMIT_LINE, ConfinedEnvironment, agent_settings  # noqa: E402
from gyre_hpc.harness.scaffold import ScaffoldRun, mini_swe_command  # noqa: E402
from gyre_hpc.models.tiny_lm import build_model  # noqa: E402
from gyre_hpc.models.tokenizer import embedded_tokenizer  # noqa: E402
from gyre_hpc.trees.builder import build_tree  # noqa: E402
from tests.harness.test_scaffold import TASK, Recording  # noqa: E402

# miniswe: conftest skips these without mini-swe-agent, and GYRE_REQUIRE_MINISWE=1 (CI) fails instead.
pytestmark = [pytest.mark.miniswe,
              pytest.mark.skipif(isolation_mode() == "plain", reason="no namespace jail can be made here")]
FIX = "printf 'def add(a, b):\\n    return a + b\\n' > calc.py"


class Scripted:
    """A policy that writes these replies in turn (the harness's teachers are such clients too)."""

    def __init__(self, replies: list[str]):
        self.replies, self.tok = list(replies), embedded_tokenizer()
        self.renderer = ChatRenderer(self.tok)

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main") -> Completion:
        ids = self.renderer.encode(self.replies.pop(0))[:max_new_tokens - 1] + [self.tok.eos_id]
        return Completion(tuple(ids), tuple(-0.5 for _ in ids))


def _mini_swe(tmp_path, client, max_tokens: int, timeout_s: float = 150.0):
    async def go():
        server = EndpointServer(ChatRenderer(embedded_tokenizer()), model_name="gyre-tiny", context_window=2048,
                                default_max_tokens=max_tokens, max_tokens_limit=max_tokens)
        server.start()
        run = ScaffoldRun(TASK, tmp_path / "ws", client, tmp_path / "r0.journal", HarnessConfig(run_timeout_s=timeout_s),
                          server, mini_swe_command(), run_id="r0")
        try:
            return run, await run.run()
        finally:
            await server.stop()

    return asyncio.run(go())


@pytest.mark.slow       # ~25 s here, most of it importing litellm on a loaded machine
def test_mini_swe_agent_fixes_the_task_through_the_jail_and_is_scored_by_its_tests(tmp_path):
    client = Recording(Scripted([f"I will fix it.\n```mswea_bash_command\n{FIX}\n```",
                                 f"Done.\n```mswea_bash_command\necho {SUBMIT_LINE}\n```"]))
    run, result = _mini_swe(tmp_path, client, max_tokens=128)
    log = run.log_path.read_text()
    assert result.status == "finished" and result.reward == 1.0, (result.error, log)
    assert "Submitted after 2 model calls" in log
    journal = load_journal(tmp_path / "r0.journal")
    assert len(journal.calls) == 2
    assert (run.session.stats.extends, run.session.stats.drift) == (1, 0)    # the echoed reply, exactly
    for call, (prompt, comp) in zip(journal.calls, client.completions):
        assert call.prompt.tolist() == list(prompt) and call.output.tolist() == list(comp.output)
    shown = embedded_tokenizer().decode(journal.calls[1].prompt.tolist())
    assert "<returncode>0</returncode>" in shown


@pytest.mark.slow
def test_mini_swe_agent_on_the_tiny_policy_trains_exactly_its_sampled_tokens(tmp_path):
    torch.set_num_threads(1)
    client = Recording(EngineCalls(TorchEngine(build_model("tiny", seed=1)), temperature=1.0).client(5))
    run, result = _mini_swe(tmp_path, client, max_tokens=12)
    assert result.status == "finished", (result.error, run.log_path.read_text())
    journal = load_journal(tmp_path / "r0.journal")
    # Random replies are format errors: mini-swe-agent keeps the error, not the reply, so each
    # call after the first is a new context from the task (a branch), never drift.
    assert len(journal.calls) == TASK.max_turns == len(client.completions) and run.session.stats.drift == 0
    tree = build_tree(result.calls)
    for k, (call, (prompt, comp)) in enumerate(zip(journal.calls, client.completions)):
        assert np.array_equal(tree.path(k), np.asarray(prompt + comp.output))
    sampled = sorted(t for _, c in client.completions for t in c.output)
    assert int(tree.trained.sum()) == len(sampled) == sum(len(c.output) for _, c in client.completions)
    assert sorted(tree.tokens[tree.trained].tolist()) == sampled


def test_confined_environment_runs_in_the_jail_and_submits_on_the_line(tmp_path):
    from minisweagent.exceptions import Submitted
    env = ConfinedEnvironment(ShellSettings(tmp_path, Limits(wall_s=10.0), None))
    out = env.execute({"command": "pwd; echo hi > f"})
    assert out["returncode"] == 0 and out["output"].splitlines()[0] == "/tmp/workspace"
    assert (tmp_path / "f").read_text() == "hi\n"
    assert env.execute({"command": "exit 3"})["returncode"] == 3
    timed = env.execute({"command": "sleep 20"}, timeout=1)
    assert timed["returncode"] == 124 and "wall clock" in timed["exception_info"]
    with pytest.raises(Submitted) as exc:
        env.execute({"command": f"echo {SUBMIT_LINE}; echo the patch"})
    assert exc.value.messages[0]["extra"]["submission"] == "the patch\n"
    assert "OPENAI_API_KEY" not in env.get_template_vars()


def test_agent_settings_take_the_turn_budget_and_a_config_file(tmp_path):
    agent, model = agent_settings(None, 6)
    assert agent["step_limit"] == 6 and agent["max_consecutive_format_errors"] == 0 and "{{task}}" in agent[
        "instance_template"]
    cfg = tmp_path / "mini.yaml"
    cfg.write_text("agent:\n  system_template: mine\n  step_limit: 99\nmodel:\n  model_name: x\n  action_regex: 'a(.*)'\n")
    agent, model = agent_settings(str(cfg), 4)
    assert agent["system_template"] == "mine" and agent["step_limit"] == 4      # the run's budget wins
    assert model["action_regex"] == "a(.*)" and "model_name" not in model
    assert sys.executable in mini_swe_command()

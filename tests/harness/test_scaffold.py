"""Outside scaffolds driven through the endpoint (harness.scaffold): a plain ``openai`` client
script started as a run's command, its commands through the confined shell, its budgets
enforced from outside; TorchEngine over a tiny decoder, the real jail, journals and trees."""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("openai", reason="openai is not installed (the test extra)")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (the endpoint extra)")

from gyre_hpc.engines.torch_engine import TorchEngine  # noqa: E402
from gyre_hpc.harness.chat_render import ChatRenderer  # noqa: E402
from gyre_hpc.harness.client import Completion  # noqa: E402
from gyre_hpc.harness.confine import Limits, isolation_mode  # noqa: E402
from gyre_hpc.harness.confined_shell import (ENV_DEADLINE, ENV_LIMITS, ENV_WORKSPACE, TIMEOUT_EXIT,  # noqa: E402
                                             USAGE_EXIT, shell_env, shell_settings)
from gyre_hpc.harness.endpoint_server import EndpointServer  # noqa: E402
from gyre_hpc.harness.engine_client import EngineCalls  # noqa: E402
from gyre_hpc.harness.journal import JournalWriter, load_journal  # noqa: E402
from gyre_hpc.harness.loop import HarnessConfig  # noqa: E402
from gyre_hpc.harness.scaffold import ScaffoldRun, scaffold_env  # noqa: E402
from gyre_hpc.harness.tasks.files import load_task  # noqa: E402
from gyre_hpc.models.tiny_lm import build_model  # noqa: E402
from gyre_hpc.models.tokenizer import embedded_tokenizer  # noqa: E402
from gyre_hpc.trees.builder import build_tree  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).with_name("scaffold_openai_client.py"))
TASK = load_task(REPO / "examples/tasks/add-two")
needs_jail = pytest.mark.skipif(isolation_mode() == "plain", reason="no namespace jail can be made here "
                                                                     "(not root, no unprivileged user namespaces)")


class Recording:
    """The run's client, keeping what the engine returned for each call."""

    def __init__(self, inner):
        self.inner, self.completions = inner, []

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main") -> Completion:
        comp = await self.inner.complete(prompt, max_new_tokens, stop, agent=agent)
        self.completions.append((tuple(prompt), comp))
        return comp


def _scaffold(tmp_path, mode: str, timeout_s: float = 90.0, task=TASK):
    torch.set_num_threads(1)

    async def go():
        calls = EngineCalls(TorchEngine(build_model("tiny", seed=1)), temperature=1.0)
        server = EndpointServer(ChatRenderer(embedded_tokenizer()), model_name="gyre-tiny", context_window=2048,
                                default_max_tokens=12, max_tokens_limit=12)
        server.start()
        client = Recording(calls.client(3))
        run = ScaffoldRun(task, tmp_path / "ws", client, tmp_path / "r0.journal", HarnessConfig(run_timeout_s=timeout_s),
                          server, [sys.executable, SCRIPT, mode], run_id="r0")
        try:
            return run, client, await run.run()
        finally:
            await server.stop()

    return asyncio.run(go())


@needs_jail
def test_openai_script_runs_turns_and_a_confined_command_and_trains_the_sampled_tokens(tmp_path):
    run, client, result = _scaffold(tmp_path, "turns")
    log = run.log_path.read_text()
    assert result.status == "finished", (result.error, log)
    assert result.reward == 1.0 and "fixed" in log                 # the tests, on the final workspace
    journal = load_journal(tmp_path / "r0.journal")
    assert journal.finished and journal.reward == 1.0 and len(journal.calls) == 3 == len(client.completions)
    for call, (prompt, comp) in zip(journal.calls, client.completions):   # journaled as the engine saw it
        assert call.prompt.tolist() == list(prompt) and call.output.tolist() == list(comp.output)
        assert np.array_equal(call.logprobs, np.asarray(comp.logprobs, np.float32))
    stats = run.session.stats
    assert (stats.calls, stats.extends, stats.branches, stats.drift) == (3, 2, 0, 0)
    tree = build_tree(result.calls)
    sampled = np.concatenate([np.asarray(c.output) for _, c in client.completions])
    assert np.array_equal(tree.tokens[tree.trained], sampled)      # one path: trained in call order
    assert np.array_equal(tree.logprobs[tree.trained],
                          np.concatenate([np.asarray(c.logprobs, np.float32) for _, c in client.completions]))
    # The command ran in the jail: the workspace is its /tmp/workspace, its uid is not the host's.
    shown = embedded_tokenizer().decode(journal.calls[1].prompt.tolist())
    assert "/tmp/workspace" in shown and "[exit 0]" in shown


@needs_jail
def test_dropped_middle_turn_branches_and_the_tree_keeps_both_contexts(tmp_path):
    run, client, result = _scaffold(tmp_path, "drop-middle")
    assert result.status == "finished", (result.error, run.log_path.read_text())
    journal = load_journal(tmp_path / "r0.journal")
    assert len(journal.calls) == 4 and run.session.stats.branches == 1 and run.session.stats.drift == 0
    inc = journal.calls.increments[3]
    assert inc.base == 0 and inc.shared == journal.calls.seq_len(0)     # from the end of call 0, exactly
    tree = build_tree(result.calls)
    for k, call in enumerate(journal.calls):                              # every context, token for token
        assert np.array_equal(tree.path(k), np.concatenate([call.prompt, call.output]))
    assert int(tree.trained.sum()) == sum(c.output.size for c in journal.calls)
    leaves = set(range(tree.n_nodes)) - set(tree.parent.tolist())
    assert len(leaves) == 2                                               # two contexts: a branch


def test_an_unfinished_scaffold_run_starts_over_and_says_it_restarted(tmp_path):
    """A scaffold's state is its own, so a relaunch cannot resume it: its journal of 2 calls is
    dropped, the run begins again at call 0 and its result counts the restart (the runs row's
    restarted_from_first)."""
    first, _, _ = _scaffold(tmp_path, "drop-middle")
    journal = load_journal(tmp_path / "r0.journal")
    w = JournalWriter.create(tmp_path / "r0.journal", "r0", TASK.task_id)
    for call in list(journal.calls)[:2]:
        w.append_call(call)
    w.close()                                       # no end record: killed mid-run
    run, client, result = _scaffold(tmp_path, "drop-middle")
    assert result.status == "finished" and result.restarted
    assert len(result.calls) == len(client.completions) == len(journal.calls)   # every call made again


def test_turn_budget_kills_the_scaffold_from_outside(tmp_path):
    t0 = time.monotonic()
    run, client, result = _scaffold(tmp_path, "forever")
    assert result.status == "finished" and len(result.calls) == TASK.max_turns == len(client.completions)
    assert run.session.spent.is_set() and run.session.closed
    assert time.monotonic() - t0 < 60
    assert result.reward < 1.0 and result.check is not None   # calc.py untouched: its tests fail


def test_wall_clock_kills_the_scaffold_process_group(tmp_path):
    run, client, result = _scaffold(tmp_path, "hang", timeout_s=8.0)
    assert result.status == "timeout" and len(result.calls) <= 1     # on a loaded machine the call may not come in time
    assert 8.0 <= result.wall_s < 30.0
    assert load_journal(tmp_path / "r0.journal").status == "timeout"


def test_scaffold_env_carries_the_session_and_drops_the_host_s_openai_settings(tmp_path):
    env = scaffold_env({"OPENAI_API_KEY": "sk-host", "OPENAI_ORG_ID": "org", "PATH": "/bin"}, url="http://h:1/v1",
                       key="gyre-k", task=TASK, workspace=tmp_path, cfg=HarnessConfig(), deadline_epoch=123.5,
                       model_name="m")
    assert env["OPENAI_API_KEY"] == "gyre-k" and env["OPENAI_BASE_URL"] == "http://h:1/v1"
    assert "OPENAI_ORG_ID" not in env and env["PATH"] == "/bin"
    assert env["GYRE_TASK_PROMPT"] == TASK.spec and env["GYRE_TURN_BUDGET"] == str(TASK.max_turns)
    assert shell_settings(env).deadline == 123.5 and shell_settings(env).workspace == tmp_path.resolve()


def test_shell_settings_round_trip_the_limits_and_name_a_bad_variable(tmp_path):
    limits = Limits(wall_s=3.0, output_bytes=77)
    assert shell_settings(shell_env(tmp_path, limits, None)).limits == limits
    with pytest.raises(ValueError, match=ENV_WORKSPACE):
        shell_settings({})
    with pytest.raises(ValueError, match=ENV_LIMITS):
        shell_settings({ENV_WORKSPACE: str(tmp_path), ENV_LIMITS: json.dumps({"wall_s": -1})})
    with pytest.raises(ValueError, match=ENV_DEADLINE):
        shell_settings({ENV_WORKSPACE: str(tmp_path), ENV_DEADLINE: "soon"})


@needs_jail
def test_confined_shell_runs_in_the_jail_and_stops_at_the_run_s_deadline(tmp_path):
    import subprocess
    env = dict(os.environ, **shell_env(tmp_path, Limits(wall_s=20.0), time.time() + 2.0))
    argv = [sys.executable, "-m", "gyre_hpc.harness.confined_shell", "-c"]
    done = subprocess.run(argv + ["pwd; echo hi > f; ls /home 2>&1 | head -1"], env=env, capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "/tmp/workspace" and (tmp_path / "f").read_text() == "hi\n"
    t0 = time.monotonic()
    done = subprocess.run(argv + ["sleep 30"], env=env, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == TIMEOUT_EXIT and time.monotonic() - t0 < 15
    done = subprocess.run(argv + ["true"], env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == USAGE_EXIT and ENV_WORKSPACE in done.stderr

"""A workspace's quota (``Limits.workspace_mb``): a model-written command or write that would
fill the disk fails that tool call, with a result the model reads, and the run goes on."""
from __future__ import annotations

import asyncio

import pytest

from gyre_hpc.harness.actions import format_action, parse_action
from gyre_hpc.harness import confine
from gyre_hpc.harness.confine import Limits, workspace_bytes
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.tokenizer import split_bytes
from gyre_hpc.harness.tools import ToolError, Workspace

from scripted import HI_TASK, ScriptClient

QUOTA = Limits(workspace_mb=4, wall_s=20.0)
# 1 MiB files one after another: each within RLIMIT_FSIZE, together 16x the quota (bounded,
# so a broken quota fails these tests instead of filling the test machine's disk), paced so
# that the command is still running at the quota's polls on any machine (a fast disk wrote
# all 64 within one poll on CI's host).
FILL = "for i in $(seq 64); do head -c 1048576 /dev/zero > fill$i || exit 9; sleep 0.02; done; echo all written"
BURST = "for i in $(seq 8); do head -c 1048576 /dev/zero > burst$i; done; echo burst written"


def test_a_command_filling_its_workspace_is_killed_at_the_quota_and_told_so(tmp_path):
    ws = Workspace(tmp_path / "ws", QUOTA)
    ws.root.mkdir()
    result = ws.run(FILL)
    assert result.returncode is None and not result.timed_out and b"all written" not in result.output
    assert result.over_quota_mb is not None and result.over_quota_mb > 4
    assert "[killed: the workspace holds" in result.describe() and "past its quota of 4 MiB" in result.describe()
    assert result.wall_s < 10                    # stopped by the quota, not the wall clock
    # Overshoot is what the command writes in one poll (QUOTA_POLL_S): far from a full disk.
    assert workspace_bytes(ws.root) < 128 << 20


def test_a_command_that_exits_past_the_quota_within_one_poll_is_told_so(tmp_path, monkeypatch):
    monkeypatch.setattr(confine, "QUOTA_POLL_S", 8.0)   # the command exits long before the first poll
    ws = Workspace(tmp_path / "ws", QUOTA)
    ws.root.mkdir()
    result = ws.run(BURST)
    assert result.returncode == 0 and b"burst written" in result.output
    assert result.over_quota_mb is not None and result.over_quota_mb > 4
    assert "[exit 0: the workspace holds" in result.describe() and "past its quota of 4 MiB" in result.describe()
    assert ws.run("rm -f burst* && echo removed").over_quota_mb is None


def test_a_file_write_past_the_quota_is_a_tool_error(tmp_path):
    ws = Workspace(tmp_path / "ws", QUOTA)
    ws.root.mkdir()
    for k in range(3):
        ws.write(f"part{k}.bin", b"x" * (1 << 20))
    with pytest.raises(ToolError, match=r"past its quota of 4 MiB \(it holds 3\.\d MiB\)"):
        ws.write("part3.bin", b"x" * (2 << 20))
    ws.write("part0.bin", b"y" * (1 << 20))      # replacing a file counts its old size out


def test_a_run_whose_command_fills_the_quota_goes_on_and_finishes(tmp_path):
    def policy(prompt):
        text = split_bytes(prompt)
        if b"past its quota" not in text:
            return format_action("exec", FILL)
        if b"removed" not in text:
            return format_action("exec", "rm -f fill* && echo removed")
        if b"wrote 2 bytes" not in text:
            return format_action("write", "ok.txt", b"hi")
        return format_action("finish")

    cfg = HarnessConfig(max_new_tokens=200, context_limit=4096, command_limits=QUOTA)
    run = AgentRun(HI_TASK, tmp_path / "ws", ScriptClient(policy), tmp_path / "r.jsonl", cfg, run_id="r")
    result = asyncio.run(run.run())
    assert result.status == "finished" and result.reward == 1.0
    assert [parse_action(c.output).tool for c in result.calls] == ["exec", "exec", "write", "finish"]
    assert b"past its quota of 4 MiB" in split_bytes(result.calls[1].prompt)

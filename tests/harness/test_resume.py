"""Resume a run: the latest snapshot, the journaled calls replayed (no engine call), the tools of
the calls after the snapshot run again, against an uninterrupted run (real harness loop, tools,
jail, checker)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np

from gyre_hpc.harness.actions import format_action
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.journal import load_journal
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.repo_teacher import RepoTeacher
from gyre_hpc.harness.resume import restore_workspace
from gyre_hpc.harness.snapshot import SnapshotStore
from gyre_hpc.harness.tasks import Task, TaskTest, load_suite
from gyre_hpc.harness.tokenizer import encode
from gyre_hpc.models.tokenizer import embedded_tokenizer
from workspace_tree import tree


class Killed(BaseException):
    """The fleet died: not an Exception, so the loop cannot catch it (no end record)."""


class StopAt:
    """Wraps a client: at call ``stop_at`` it raises, as a killed fleet would."""

    def __init__(self, inner, stop_at: int):
        self.inner, self.stop_at, self.k = inner, stop_at, 0

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        k, self.k = self.k, self.k + 1
        if k == self.stop_at:
            raise Killed(f"call {k}")
        return await self.inner.complete(prompt, max_new_tokens, stop, agent=agent)


class Counting:
    """Counts the engine calls a resumed run makes."""

    def __init__(self, inner):
        self.inner, self.n = inner, 0

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        self.n += 1
        return await self.inner.complete(prompt, max_new_tokens, stop, agent=agent)


class Scripted:
    """The k-th call's output is ``outputs[k]``, whatever the prompt."""

    def __init__(self, outputs):
        self.outputs, self.k = outputs, 0

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        out = self.outputs[self.k]
        self.k += 1
        return Completion(tuple(out), tuple(-1.0 for _ in out), 3)


EFFECTS = Task(task_id="effects", spec="Change files.", files={"b.txt": "bee", "keep.txt": "kept"},
               tests=(TaskTest("has_a", "import os\nassert os.path.isfile('a.txt')"),), max_turns=12)
OUTPUTS = [
    format_action("write", "a.txt", "one"),
    format_action("exec", "mkdir -p d/e && printf x > d/e/f && chmod 700 d && rm b.txt"),
    encode("plain text goes to the answer file") + [embedded_tokenizer().eos_id],
    format_action("write", "d/g", "g"),
    format_action("exec", "printf more >> a.txt && chmod 600 a.txt"),
    format_action("read", "a.txt"),
    format_action("exec", "ln -s a.txt link && mkfifo pipe && printf y > d/e/h"),
    format_action("write", "c.txt", "c"),
    format_action("exec", "rm -r d/e && printf z >> answer.txt"),
    format_action("list"),
    format_action("finish"),
]


def _run(tmp_path: Path, client, name: str, task: Task, cfg: HarnessConfig = HarnessConfig(), **snapshots):
    ws = tmp_path / name
    result = asyncio.run(AgentRun(task, ws, client, tmp_path / f"{name}.journal", cfg, run_id=name, **snapshots).run())
    return ws, result


def _interrupt(tmp_path: Path, client, name: str, task: Task, cfg: HarnessConfig = HarnessConfig(), **snapshots):
    try:
        _run(tmp_path, client, name, task, cfg, **snapshots)
    except Killed:
        pass
    else:
        raise AssertionError("the run was not interrupted")
    return load_journal(tmp_path / f"{name}.journal")


def _copy_run(tmp_path: Path, src: str, dst: str) -> None:
    """A second copy of an interrupted run (journal, snapshots) to resume on its own."""
    shutil.copy(tmp_path / f"{src}.journal", tmp_path / f"{dst}.journal")
    shutil.copytree(tmp_path / f"{src}-store", tmp_path / f"{dst}-store")


def _same_calls(a, b) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.prompt, y.prompt) and np.array_equal(x.output, y.output)
        and np.array_equal(x.logprobs, y.logprobs) for x, y in zip(a, b))


def test_restore_workspace_takes_the_newest_snapshot_before_the_last_call(tmp_path):
    store = SnapshotStore(tmp_path / "run-store", durable=False)
    state = _interrupt(tmp_path, StopAt(Scripted(OUTPUTS), 10), "run", EFFECTS, snapshots=store, snapshot_every=4)
    assert len(state.calls) == 10 and store.calls() == [3, 7]
    done = restore_workspace(state, store, EFFECTS, tmp_path / "restored")
    assert (done.snapshot_call, done.last_call, done.redo_from) == (7, 9, 8)
    assert tree(tmp_path / "restored") == tree_of_manifest(store, 7, tmp_path)
    done = restore_workspace(state, None, EFFECTS, tmp_path / "restored")
    assert (done.snapshot_call, done.redo_from) == (None, 0)
    EFFECTS.materialize(tmp_path / "initial")
    assert tree(tmp_path / "restored") == tree(tmp_path / "initial")
    # The snapshot of the last journaled call is not used: that call's result text is in no prompt.
    cut = load_journal(tmp_path / "run.journal")
    cut.calls = type(cut.calls)(cut.calls.increments[:8])
    assert restore_workspace(cut, store, EFFECTS, tmp_path / "restored").snapshot_call == 3


def tree_of_manifest(store, call, tmp_path):
    store.restore(store.load(call), tmp_path / "from-manifest")
    return tree(tmp_path / "from-manifest")


def test_resumed_run_equals_the_uninterrupted_one_with_no_engine_call_redone(tmp_path):
    """Cut after 10 calls (acted on), resumed: the journaled calls come from the journal, the
    snapshot of call 7 is restored and only calls 8 and 9 run their tools again; the calls,
    the workspace and the journal equal an uninterrupted run's."""
    _, whole = _run(tmp_path, Scripted(OUTPUTS), "whole", EFFECTS)
    store = SnapshotStore(tmp_path / "run-store", durable=False)
    (tmp_path / "earlier").mkdir()
    store.snapshot(tmp_path / "earlier", 99)     # left by an earlier attempt: a fresh start drops it
    state = _interrupt(tmp_path, StopAt(Scripted(OUTPUTS), 10), "run", EFFECTS, snapshots=store, snapshot_every=4)
    assert state.status == "running" and len(state.calls) == 10 and store.calls() == [3, 7]
    _copy_run(tmp_path, "run", "older")
    client = Counting(Scripted(OUTPUTS[10:]))
    ws, resumed = _run(tmp_path, client, "run", EFFECTS, snapshots=store, snapshot_every=4)
    assert client.n == 1 and resumed.replayed == 10 and not resumed.restarted
    assert (resumed.snapshot_call, resumed.tools_redone) == (7, 2)
    assert (resumed.status, resumed.reward) == (whole.status, whole.reward) == ("finished", 1.0)
    assert _same_calls(resumed.calls, whole.calls)
    assert _same_calls(load_journal(tmp_path / "run.journal").calls, whole.calls)
    assert tree(ws) == tree(tmp_path / "whole")
    # An older snapshot: more tools run again, the same run.
    older = SnapshotStore(tmp_path / "older-store", durable=False)
    older.manifest_path(7).unlink()
    client = Counting(Scripted(OUTPUTS[10:]))
    ws, resumed = _run(tmp_path, client, "older", EFFECTS, snapshots=older, snapshot_every=4)
    assert client.n == 1 and (resumed.snapshot_call, resumed.tools_redone) == (3, 6) and not resumed.restarted
    assert _same_calls(resumed.calls, whole.calls) and tree(ws) == tree(tmp_path / "whole")


def test_resumed_xlong_mini_run_equals_the_uninterrupted_one(tmp_path):
    """A real task and its teacher (tool calls, delegations, scoped tests, a
    retry): cut mid-run and resumed from the last snapshot, the run's calls and its final
    workspace equal an uninterrupted run's; at most ``snapshot_every`` calls run their tools
    again and none asks the model again. ``__pycache__`` is left out: the checker's workers
    write it, and a .pyc holds its source's mtime, which a replayed write does not keep."""
    task = next(t for t in load_suite("xlong-mini") if t.task_id == "xm-p2")
    cfg = HarnessConfig(max_new_tokens=160, context_limit=4096, run_timeout_s=3600)
    full_ws, full = _run(tmp_path, RepoTeacher(task, seed=0), "full", task, cfg)
    n = len(full.calls)
    assert full.status == "finished" and n > 20 and full.delegations and full.retries
    cut = n // 2 + 3
    store = SnapshotStore(tmp_path / "cut-store", durable=False)
    teacher = RepoTeacher(task, seed=0)     # reactive and stateful: the resumed run goes on with it
    state = _interrupt(tmp_path, StopAt(teacher, cut), "cut", task, cfg, snapshots=store, snapshot_every=8)
    assert len(state.calls) == cut and _same_calls(state.calls, full.calls[:cut])
    client = Counting(teacher)
    ws, resumed = _run(tmp_path, client, "cut", task, cfg, snapshots=store, snapshot_every=8)
    print(f"xm-p2: {n} calls, cut at {cut}, snapshot {resumed.snapshot_call}, tools redone {resumed.tools_redone}")
    assert not resumed.restarted and resumed.replayed == cut and client.n == n - cut
    assert resumed.snapshot_call == (cut - 1) // 8 * 8 - 1     # the newest before the last journaled call
    assert 0 < resumed.tools_redone <= 8
    assert _same_calls(resumed.calls, full.calls) and resumed.reward == full.reward
    assert tree(ws, skip=("__pycache__",)) == tree(full_ws, skip=("__pycache__",))


def test_a_refused_snapshot_costs_the_run_nothing_but_that_snapshot(tmp_path):
    store = SnapshotStore(tmp_path / "store", durable=False, max_file_bytes=4)
    run = AgentRun(EFFECTS, tmp_path / "ws", Scripted(OUTPUTS), tmp_path / "ws.journal", run_id="ws",
                   snapshots=store, snapshot_every=2)
    result = asyncio.run(run.run())
    # After call 1 every file is under the store's 4-byte limit; call 2 appends 34 bytes to
    # the answer file, so the snapshots after calls 3, 5, 7 and 9 are refused.
    assert result.status == "finished" and len(result.calls) == 11
    assert store.calls() == [1] and run.snapshots_refused == 4

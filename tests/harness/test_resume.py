"""Resume a workspace: the latest snapshot, then the journaled calls' tool effects made again,
against the workspace an uninterrupted run left (real harness loop, tools, jail, checker)."""
from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

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


class Interrupted(Exception):
    """The fleet died: the client stops answering at a given call."""


class StopAt:
    """Wraps a client: at call ``stop_at`` it raises, as a killed fleet would."""

    def __init__(self, inner, stop_at: int):
        self.inner, self.stop_at, self.k = inner, stop_at, 0

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        k, self.k = self.k, self.k + 1
        if k == self.stop_at:
            raise Interrupted(f"call {k}")
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


def test_snapshot_then_replayed_effects_equal_the_interrupted_workspace(tmp_path):
    store = SnapshotStore(tmp_path / "store", durable=False)
    ws = tmp_path / "run"
    (tmp_path / "earlier").mkdir()
    store.snapshot(tmp_path / "earlier", 99)     # left by an earlier attempt: a fresh start drops it
    stop = 10    # calls 0..9 journaled and acted on; the fleet dies before call 10 (the finish)
    _, result = _run(tmp_path, StopAt(Scripted(OUTPUTS), stop), "run", EFFECTS, snapshots=store, snapshot_every=4)
    assert result.status == "failed" and "Interrupted" in result.error and len(result.calls) == stop
    assert store.calls() == [3, 7]
    left = tree(ws)
    assert left["a.txt"] == ("file", 0o600, b"onemore") and "b.txt" not in left and "d/e" not in left
    assert left["link"] == ("link", "a.txt") and left["answer.txt"][2].endswith(b"z")
    state = load_journal(tmp_path / "run.journal")

    done = restore_workspace(state, store, EFFECTS, tmp_path / "resumed")
    assert (done.snapshot_call, done.replayed, done.last_call) == (7, (8,), 9)     # call 9 lists: no effect
    assert tree(tmp_path / "resumed") == left
    # An older snapshot: more calls made again, the same workspace.
    store.manifest_path(7).unlink()
    done = restore_workspace(state, store, EFFECTS, tmp_path / "resumed")
    assert (done.snapshot_call, done.replayed) == (3, (4, 6, 7, 8))
    assert tree(tmp_path / "resumed") == left
    # No snapshot at all: the task's files and every call's effect (what a resume costs today).
    done = restore_workspace(state, None, EFFECTS, tmp_path / "resumed")
    assert (done.snapshot_call, done.replayed) == (None, (0, 1, 2, 3, 4, 6, 7, 8))
    assert tree(tmp_path / "resumed") == left


def test_resumed_xlong_mini_workspace_equals_the_uninterrupted_runs(tmp_path):
    """A real task and its teacher (tool calls, delegations, scoped tests, compressions): cut
    mid-run, restored from the last snapshot plus replay, the workspace equals the one the
    run had at the cut. ``__pycache__`` is left out: the checker's workers write it, and a
    .pyc holds its source's mtime, which a replayed write does not keep."""
    task = next(t for t in load_suite("xlong-mini") if t.task_id == "xm-p2")
    cfg = HarnessConfig(max_new_tokens=160, context_limit=4096, run_timeout_s=3600)
    full_ws, full = _run(tmp_path, RepoTeacher(task, seed=0), "full", task, cfg)
    n = len(full.calls)
    assert full.status == "finished" and n > 20
    cut = n // 2 + 3
    store = SnapshotStore(tmp_path / "store", durable=False)
    ws = tmp_path / "cut"
    _, part = _run(tmp_path, StopAt(RepoTeacher(task, seed=0), cut), "cut", task, cfg, snapshots=store,
                   snapshot_every=8)
    assert len(part.calls) == cut and part.status == "failed"
    state = load_journal(tmp_path / "cut.journal")
    # The cut run made the same calls as the whole one up to the cut.
    assert all((state.calls[k].output == full.calls[k].output).all() for k in range(cut))
    done = restore_workspace(state, store, task, tmp_path / "resumed", cfg)
    assert done.snapshot_call == (cut - 1) // 8 * 8 - 1 and done.last_call == cut - 1
    print(f'xm-p2: {n} calls, cut at {cut}, snapshot {done.snapshot_call}, replayed {done.replayed}')
    assert done.replayed and done.replayed[-1] <= cut - 1
    assert tree(tmp_path / "resumed", skip=("__pycache__",)) == tree(ws, skip=("__pycache__",))


def test_a_refused_snapshot_costs_the_run_nothing_but_that_snapshot(tmp_path):
    store = SnapshotStore(tmp_path / "store", durable=False, max_file_bytes=4)
    run = AgentRun(EFFECTS, tmp_path / "ws", Scripted(OUTPUTS), tmp_path / "ws.journal", run_id="ws",
                   snapshots=store, snapshot_every=2)
    result = asyncio.run(run.run())
    # After call 1 every file is under the store's 4-byte limit; call 2 appends 34 bytes to
    # the answer file, so the snapshots after calls 3, 5, 7 and 9 are refused.
    assert result.status == "finished" and len(result.calls) == 11
    assert store.calls() == [1] and run.snapshots_refused == 4

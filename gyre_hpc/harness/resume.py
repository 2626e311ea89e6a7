"""Bring a run's workspace back for a resume: the latest usable snapshot (design.md section 11).

The journal records each call's tokens, not what its tool did to the workspace. A resume
restores the newest snapshot of a call before the journal's last one (or the task's files)
and the agent loop (``loop.AgentRun``) then replays the journal: the calls up to the
snapshot are taken from the journal without running their tools (their effects are in the
snapshot; the next journaled prompt holds their result text), the calls after it run their
tools again through the loop's one dispatch (``AgentRun._execute``), so their result texts
are made again and checked against the journaled prompts. The snapshot is of a call before
the last one because the last call's result text is in no journaled prompt: its tool must run.

That is exact for the file tools (``write``, the default ``answer``) and for deterministic
commands; a command whose effect depends on time, chance or the machine (``date > f``, a
wall-clock timeout hit under load) may leave other bytes than it did in the run, and a
result text that differs from the journal's abandons the replay (the run restarts cleanly).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness.journal import JournalState
from gyre_hpc.harness.snapshot import SnapshotStore
from gyre_hpc.harness.tasks import Task


@dataclass(frozen=True)
class Restored:
    snapshot_call: int | None     # the snapshot restored (None: the task's initial files)
    last_call: int                # the last journaled call (-1: none)

    @property
    def redo_from(self) -> int:
        """The first journaled call whose tool runs again on resume."""
        return 0 if self.snapshot_call is None else self.snapshot_call + 1


def restore_workspace(state: JournalState, store: SnapshotStore | None, task: Task,
                      workspace: str | Path) -> Restored:
    """Make ``workspace`` the newest snapshot of a call before the journal's last one (none:
    ``task``'s initial files); the calls from ``Restored.redo_from`` on have their tools run
    again by the loop's replay."""
    last = len(state.calls) - 1
    manifest = store.latest(at_most=last - 1) if store is not None and last >= 1 else None
    if manifest is not None:
        store.restore(manifest, workspace)
    else:
        task.materialize(workspace)
    return Restored(manifest.call if manifest is not None else None, last)

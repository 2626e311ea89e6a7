"""Bring a run's workspace back to where its journal ends: the latest snapshot, then the tool
effects of the journaled calls after it (design.md section 11).

The journal records each call's tokens, not what its tool did to the workspace, so the
effects after the snapshot are made again: each journaled output is parsed into its action
(``actions.parse_action``, as the loop does) and run on the restored workspace through the
same tools and confinement. That is exact for the file tools (``write``, the default
``answer``) and for deterministic commands; a command whose effect depends on time, chance
or the machine (``date > f``, a wall-clock timeout hit under load) may leave other bytes than
it did in the run. The task's tests are run where the run ran them (``test``, and the main
agent's ``finish``), since workspace code the tests import runs in the workspace and may
write there (``__pycache__``). A call's own result text is not needed: the next journaled
prompt already holds it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness.actions import parse_action
from gyre_hpc.harness.journal import JournalState
from gyre_hpc.harness.loop import HarnessConfig
from gyre_hpc.harness.snapshot import SnapshotStore
from gyre_hpc.harness.tasks import Task, check_workspace
from gyre_hpc.harness.tools import ToolError, Workspace
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer

# Tools that change nothing in the workspace: their calls are skipped on replay.
NO_EFFECT = frozenset({"read", "list", "delegate"})


@dataclass(frozen=True)
class Restored:
    snapshot_call: int | None     # the snapshot restored (None: the task's initial files)
    replayed: tuple[int, ...]     # calls whose tool effects were made again, in order
    last_call: int                # the last journaled call (-1: none)


def restore_workspace(state: JournalState, store: SnapshotStore | None, task: Task, workspace: str | Path,
                      cfg: HarnessConfig = HarnessConfig(), tokenizer: ChatTokenizer | None = None) -> Restored:
    """Make ``workspace`` the state after the journal's last call: the newest snapshot of a
    journaled call (none: ``task``'s initial files), then the effects of every call after it."""
    last = len(state.calls) - 1
    manifest = store.latest(at_most=last) if store is not None else None
    if manifest is not None:
        store.restore(manifest, workspace)
        first = manifest.call + 1
    else:
        task.materialize(workspace)
        first = 0
    tok = tokenizer or embedded_tokenizer()
    ws = Workspace(Path(workspace), cfg.command_limits)
    replayed = []
    for k in range(first, last + 1):
        call = state.calls.increments[k]
        if call.role == "summary":
            continue    # a summary's output is context, never an action
        if replay_effect(ws, task, parse_action(call.output, tok), call.agent, cfg):
            replayed.append(k)
    return Restored(manifest.call if manifest is not None else None, tuple(replayed), last)


def replay_effect(ws: Workspace, task: Task, action, agent: str, cfg: HarnessConfig) -> bool:
    """Make one action's workspace effect again, as ``AgentRun._execute`` made it (a refused
    tool is refused again, to the same effect: none); True if the action has one."""
    if action.tool in NO_EFFECT or (action.tool == "finish" and agent != "main"):
        return False
    try:
        if action.tool == "answer":
            ws.write(task.answer_file, action.args[0], append=True)
        elif action.tool == "write":
            ws.write(action.text(0), action.args[1])
        elif action.tool == "exec":
            ws.run(action.text())
        elif action.tool in ("test", "finish"):
            scope = action.text().strip() if action.tool == "test" else ""
            check_workspace(task.scoped(scope) if scope else task, ws.root, cfg.check_limits)
        else:
            raise ValueError(f"replay: unhandled tool {action.tool!r}")
    except ToolError:
        pass
    return True

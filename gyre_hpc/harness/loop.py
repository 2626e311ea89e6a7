"""The agent loop: one run of one task, a coroutine over a workspace, journaled call by call.

Context layout (token ids, built with the tokenizer's chat template, see tokenizer.py):
    intro   = system message, user message (the task spec)
    context = intro <assistant generation prompt>                      the first prompt
    next    = context <output> <end of turn> <tool result turn> <generation prompt>
so each prompt extends the previous prompt+output and the calls of one context share one
path in the trajectory tree. Three things start a new branch instead:
- compression: when ``len(context) + max_new_tokens + len(summary request)`` passes
  ``context_limit``, a ``summary`` call sees the context with a user turn "summarize..."
  and the context restarts as ``intro`` + a user turn "summary: <summary text>";
- retry: when the main agent finishes and the tests do not all pass, the context restarts
  from its anchor (the intro, or the last compressed context) plus the test report, at most
  ``max_retries`` times; the workspace keeps its files (the retry sees the report);
- delegation: a ``delegate`` call runs a sub-agent with its own intro (role
  ``subagent``, agent ``sub<k>``) over the same workspace for ``subagent_turns`` calls;
  its finish message (or "turn budget spent") is the tool result the parent sees.
The run ends with status ``finished`` (finish with a pass, retries spent, or turns spent),
``timeout`` (the wall clock ran out; the workspace is kept and scored as it is) or
``failed`` (the model client or the checker raised). Every status is scored by the task's
checker; a run whose checker crashes scores 0 with the crash as its error.

Snapshots: given a ``SnapshotStore``, the workspace is saved as call k-1 left it just before
a new call k whenever ``snapshot_due(k - 1, snapshot_every)``.

Resume: with ``resume=True`` an unfinished journal is replayed; no journaled call asks the
model again (its journaled tokens, logprobs and policy version are the call's result). The
workspace comes back from the newest snapshot of a call S before the journal's last one
(``resume.restore_workspace``; without one, the task's files and S = -1). Calls up to S do
not run their tools (their effects are in the snapshot): the context after such a call is
the next journaled prompt, which holds its result text (a main agent's finish there was
followed by a retry). Calls after S run their tools again through ``_execute``, the one
dispatch, so at most ``snapshot_every`` calls' tools run twice. Every replayed prompt is
checked against the journal; the first that differs (a tool that is not deterministic)
abandons the replay and restarts the run cleanly (new journal, fresh workspace, counted as
``restarted``). The wall clock restarts on resume.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from gyre_hpc import fsio
from gyre_hpc.harness.actions import Action, parse_action
from gyre_hpc.harness.client import Completion, ModelClient
from gyre_hpc.harness.confine import Limits
from gyre_hpc.harness.context import TokenContext
from gyre_hpc.harness.journal import JournalState, JournalWriter, load_journal
from gyre_hpc.harness.resume import restore_workspace
from gyre_hpc.harness.snapshot import SnapshotError, SnapshotStore, snapshot_due
from gyre_hpc.harness.tasks import CheckReport, Task, check_workspace, score_workspace
from gyre_hpc.harness.tokenizer import ChatFormat, truncate_utf8
from gyre_hpc.harness.tools import ToolError, Workspace
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer
from gyre_hpc.trees.calls import CallIncrement, CallLog

# Short on purpose: a tiny model pays for every prompt token at each call.
SYSTEM_TEXT = ("One tool call per turn: read, write, list, exec, test, delegate, finish. "
               "Plain text goes to the answer file.")
SUBAGENT_TEXT = "Sub-agent: do the subtask, then finish."
SUMMARY_REQUEST = "Summarize your progress."


@dataclass(frozen=True)
class HarnessConfig:
    max_new_tokens: int = 64
    context_limit: int = 1024
    run_timeout_s: float = 120.0
    max_retries: int = 1
    max_delegations: int = 2
    subagent_turns: int = 4
    subtask_bytes: int = 128
    tool_output_bytes: int = 256
    command_limits: Limits = field(default_factory=Limits)
    check_limits: Limits = field(default_factory=lambda: Limits(wall_s=20.0, output_bytes=1 << 16))

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "context_limit", "run_timeout_s", "subagent_turns", "subtask_bytes",
                     "tool_output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HarnessConfig.{name}={getattr(self, name)} must be > 0")
        for name in ("max_retries", "max_delegations"):
            if getattr(self, name) < 0:
                raise ValueError(f"HarnessConfig.{name}={getattr(self, name)} must be >= 0")

    @classmethod
    def from_rollout(cls, rollout, **overrides) -> "HarnessConfig":
        """From the run config's ``rollout`` section (config.RolloutConfig)."""
        fields = dict(max_new_tokens=rollout.max_new_tokens, context_limit=rollout.context_limit,
                      run_timeout_s=rollout.run_timeout_s, max_retries=rollout.max_retries,
                      max_delegations=rollout.max_delegations, subagent_turns=rollout.subagent_turns,
                      tool_output_bytes=rollout.tool_output_bytes)
        if rollout.allow_unconfined:
            base = cls()
            fields["command_limits"] = replace(base.command_limits, allow_unconfined=True)
            fields["check_limits"] = replace(base.check_limits, allow_unconfined=True)
        return cls(**{**fields, **overrides})


@dataclass(frozen=True)
class RunResult:
    run_id: str
    task_id: str
    status: str
    reward: float
    wall_s: float
    calls: CallLog                # the run's calls (increments; ``calls[k]`` is call k whole)
    check: CheckReport | None
    retries: int = 0
    compressions: int = 0
    delegations: int = 0
    replayed: int = 0             # journaled calls replayed (no engine call)
    error: str | None = None      # why a run "failed" (the client's exception)
    snapshot_call: int | None = None   # the snapshot a resume restored (None: none)
    tools_redone: int = 0         # journaled calls whose tools ran again on resume (<= snapshot_every)
    restarted: bool = False       # a journal with calls was abandoned: the run began again at call 0


class RunTimeout(Exception):
    pass


class ReplayDiverged(Exception):
    pass


class AgentRun:
    """One run; ``await AgentRun(...).run()``. Not reusable: make one per run."""

    def __init__(self, task: Task, workspace: str | Path, client: ModelClient, journal_path: str | Path,
                 cfg: HarnessConfig = HarnessConfig(), run_id: str = "run",
                 tokenizer: ChatTokenizer | None = None, snapshots: SnapshotStore | None = None,
                 snapshot_every: int = 8) -> None:
        self.task, self.client, self.cfg, self.run_id = task, client, cfg, run_id
        # The workspace saved after every ``snapshot_every`` calls (rollout.snapshot_every), for
        # ``harness.resume``; not in HarnessConfig, whose repr keys the warm-start cache.
        if snapshot_every <= 0:
            raise ValueError(f"AgentRun snapshot_every={snapshot_every} must be > 0")
        self.snapshots, self.snapshot_every = snapshots, snapshot_every
        self.snapshots_refused = 0
        # The policy's own tokenizer (a checkpoint brings one); the embedded default otherwise.
        self.tokenizer = tokenizer or embedded_tokenizer()
        self.chat = ChatFormat(self.tokenizer)
        self.gen = self.chat.generation_prompt()
        self.workspace_path = Path(workspace)
        self.journal_path = Path(journal_path)
        intro = self._intro(SYSTEM_TEXT, task.spec)
        if self._summary_budget(intro) < 0:
            raise ValueError(
                f"rollout.context_limit={cfg.context_limit} is too small for task {task.task_id!r}: its "
                f"header is {len(intro)} tokens, plus max_new_tokens={cfg.max_new_tokens} and the summary request")

    # ---- context pieces -------------------------------------------------------------
    def _intro(self, system: str, *user_texts: str) -> list[int]:
        ids = self.chat.message("system", system)
        for text in user_texts:
            ids += self.chat.message("user", text)
        return ids

    def _summary_request(self) -> list[int]:
        return self.chat.message("user", SUMMARY_REQUEST) + self.gen

    def _summary_budget(self, intro: list[int]) -> int:
        overhead = len(self._summary_request()) + len(self.chat.message("user", "summary: ")) + len(self.gen)
        return self.cfg.context_limit - self.cfg.max_new_tokens - overhead - len(intro)

    def _needs_compression(self, context: TokenContext) -> bool:
        return len(context) + self.cfg.max_new_tokens + len(self._summary_request()) > self.cfg.context_limit

    # ---- the run --------------------------------------------------------------------
    async def run(self, resume: bool = True) -> RunResult:
        state = load_journal(self.journal_path) if resume and self.journal_path.exists() else None
        if state is not None and state.finished:
            return RunResult(self.run_id, self.task.task_id, state.status, state.reward or 0.0, state.wall_s or 0.0,
                             state.calls, None)
        try:
            return await self._run_once(state)
        except ReplayDiverged:
            result = await self._run_once(None)
            return replace(result, restarted=True)

    async def _run_once(self, state: JournalState | None) -> RunResult:
        # A workspace is reset only when this run's journal shows the run owns it.
        if not self.journal_path.exists() and self.workspace_path.exists() and any(self.workspace_path.iterdir()):
            raise FileExistsError(
                f"workspace {self.workspace_path} is not empty and has no journal at {self.journal_path}: "
                f"refusing to overwrite files this run did not create")
        # Calls <= skip_upto are replayed without running their tools: the snapshot holds their effects.
        self.skip_upto, self.tools_redone, self.snapshot_call = -1, 0, None
        if state is not None and len(state.calls):
            restored = restore_workspace(state, self.snapshots, self.task, self.workspace_path)
            self.snapshot_call = restored.snapshot_call
            self.skip_upto = -1 if restored.snapshot_call is None else restored.snapshot_call
        else:
            self.task.materialize(self.workspace_path)
        if state is None and self.snapshots is not None:
            self.snapshots.drop_after(-1)    # a fresh start: an earlier attempt's snapshots are not of this run
        self.ws = Workspace(self.workspace_path, self.cfg.command_limits)
        self.replay = state.calls if state is not None else CallLog()
        self.writer = JournalWriter.reopen(state) if state is not None else \
            JournalWriter.create(self.journal_path, self.run_id, self.task.task_id)
        self.calls = CallLog()      # increments: a run holds its unique tokens once (trees.calls)
        self.retries = self.compressions = self.delegations = 0
        self.last_check: CheckReport | None = None
        start = time.monotonic()
        self.deadline = start + self.cfg.run_timeout_s
        status, error = "finished", None
        try:
            await self._agent("main", "main", self._intro(SYSTEM_TEXT, self.task.spec), self.task.max_turns)
        except RunTimeout:
            status = "timeout"
        except ReplayDiverged:
            self.writer.close()
            raise
        except Exception as exc:  # noqa: BLE001 - a failed run is still scored and journaled
            if fsio.is_disk_full(exc):
                raise   # the journal's disk, not the run: the fleet stops (tools report their own)
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        # Scored from the workspace as it is, whatever the status: partial progress counts.
        check, crash = await asyncio.to_thread(score_workspace, self.task, self.workspace_path, self.cfg.check_limits)
        if crash:
            status, error = "failed", f"{error}; {crash}" if error else crash
        wall = time.monotonic() - start
        self.writer.end(status, check.score, wall, list(check.passed))
        return RunResult(self.run_id, self.task.task_id, status, check.score, wall, self.calls, check,
                         self.retries, self.compressions, self.delegations, min(len(self.replay), len(self.calls)), error,
                         self.snapshot_call, self.tools_redone)

    def _remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RunTimeout()
        return left

    async def _call(self, context: TokenContext, role: str, agent: str) -> Completion:
        """One model call on ``context``; journaled as an increment of the call its origin names."""
        remaining = self._remaining()
        k = len(self.calls)
        prompt = context.array  # materialised once, for the client (and a replay's check)
        if k < len(self.replay):
            rec = self.replay.increments[k]
            if not np.array_equal(self.replay.prompt(k), prompt) or rec.role != role or rec.agent != agent:
                raise ReplayDiverged(f"call {k}: the replayed prompt differs from the journal")
            comp = Completion(tuple(rec.output.tolist()), tuple(rec.logprobs.tolist()), rec.policy_version)
            self.calls.append(rec)
            return comp
        if self.snapshots is not None and k > 0 and snapshot_due(k - 1, self.snapshot_every):
            await self._snapshot(k - 1)
        try:
            comp = await asyncio.wait_for(self.client.complete(prompt.tolist(), self.cfg.max_new_tokens, self.chat.stop_ids(),
                                                               agent=agent), remaining)
        except asyncio.TimeoutError:
            raise RunTimeout() from None
        base, shared = context.origin or (-1, 0)
        call = CallIncrement(base, shared, context.tail(shared), comp.output, comp.logprobs, role=role, agent=agent,
                             policy_version=comp.policy_version)
        self.writer.append(call)
        self.calls.append(call)
        return comp

    async def _snapshot(self, call: int) -> None:
        """Save the workspace as call ``call`` left it. A workspace the store refuses (a huge
        sparse file, a tree too deep) costs the run nothing but this snapshot: a resume falls
        back to an earlier one."""
        try:
            await asyncio.to_thread(self.snapshots.snapshot, self.workspace_path, call)
        except SnapshotError:
            self.snapshots_refused += 1

    async def _compress(self, context: TokenContext, intro: list[int], agent: str) -> TokenContext:
        base = context.prefix(len(context) - len(self.gen))   # the context without its open assistant turn
        comp = await self._call(base.extend(self._summary_request()), "summary", agent)
        self.compressions += 1
        kept = self.tokenizer.encode(self.chat.text(comp.output))[: max(self._summary_budget(intro), 0)]
        return TokenContext.of(intro + self.chat.message("user", "summary: " + self.chat.text(kept)) + self.gen)

    async def _agent(self, agent: str, role: str, intro: list[int], max_turns: int) -> str:
        """Run one agent's turns; returns its finish message (what a parent sees)."""
        # Contexts share their segments (context.py): a branch keeps its prefix by reference, and
        # each one knows which call's tokens it starts with, so a call is journaled and built
        # into the tree by its new tokens.
        anchor = context = TokenContext.of(intro + self.gen)
        pending = False     # the context ends at a skipped call's output: the journal holds the rest
        for _ in range(max_turns):
            if pending:
                context, pending = self._journaled_context(context), False
            if self._needs_compression(context):
                context = anchor = await self._compress(context, intro, agent)
            comp = await self._call(context, role, agent)
            k = len(self.calls) - 1
            if context is anchor:
                anchor = anchor.as_call(k)     # a retry rewinds to this call's prompt
            action = parse_action(comp.output, self.tokenizer)
            if k <= self.skip_upto and action.tool not in ("delegate", "finish"):
                # Restored from the snapshot: no tool runs; the next journaled prompt has its result.
                context, pending = context.extend(comp.output).as_call(k), True
                continue
            if k < len(self.replay) and k > self.skip_upto:
                self.tools_redone += 1
            if k <= self.skip_upto and action.tool == "finish" and agent == "main":
                # A main finish the journal goes on after: its check failed and a retry followed.
                self.retries += 1
                context = self._journaled_context(anchor.prefix(len(anchor) - len(self.gen)))
                continue
            result, finished = await self._execute(action, agent)
            if finished and agent == "main":
                report = await self._check()
                if report.score < 1.0 and self.retries < self.cfg.max_retries:
                    self.retries += 1
                    context = anchor.prefix(len(anchor) - len(self.gen)).extend(
                        self.chat.message("user", f"retry {self.retries}: " + self._report(report)) + self.gen)
                    continue
                return result
            if finished:
                return result
            shown = truncate_utf8(result, self.cfg.tool_output_bytes)
            context = context.extend(comp.output).as_call(k).extend(
                self.chat.end_of_turn(comp.output) + self.chat.tool_result(shown) + self.gen)
        return "turn budget spent"

    def _journaled_context(self, base: TokenContext) -> TokenContext:
        """``base`` extended as the next journaled call's prompt goes on from it (that call's
        new tokens; a summary call's without its request, plus the generation prompt, since the
        loop asks for the summary itself). The next prompt check confirms it."""
        k = len(self.calls)
        if k >= len(self.replay):
            raise ReplayDiverged(f"call {k}: the journal ends before the result of a restored call")
        rec = self.replay.increments[k]
        if base.origin is None or (rec.base, rec.shared) != base.origin or rec.shared != len(base):
            raise ReplayDiverged(f"call {k}: its prompt does not extend the restored context")
        new = rec.new
        if rec.role == "summary":
            request = self._summary_request()
            if new.size < len(request):
                raise ReplayDiverged(f"call {k}: a summary call without its request")
            return base.extend(np.concatenate([new[:new.size - len(request)], np.asarray(self.gen, np.int32)]))
        return base.extend(new)

    def _report(self, report: CheckReport) -> str:
        return report.summary(failures=self.task.report_failures)

    async def _check(self, task: Task | None = None) -> CheckReport:
        """The task's tests on the workspace now (``task``: the same task with a scoped subset)."""
        limits = replace(self.cfg.check_limits, wall_s=min(self.cfg.check_limits.wall_s, self._remaining()))
        report = await asyncio.to_thread(check_workspace, task or self.task, self.workspace_path, limits)
        if task is None:
            self.last_check = report
        return report

    async def _execute(self, action: Action, agent: str) -> tuple[str, bool]:
        """(tool result text, whether the agent finished)."""
        try:
            if action.tool == "finish":
                return action.text() or "done", True
            if action.tool == "answer":
                n = self.ws.write(self.task.answer_file, action.args[0], append=True)
                return f"appended {n} bytes to {self.task.answer_file}", False
            if action.tool == "read":
                return self.ws.read(action.text()).decode("utf-8", errors="replace"), False
            if action.tool == "write":
                n = self.ws.write(action.text(0), action.args[1])
                return f"wrote {n} bytes to {action.text(0).strip()}", False
            if action.tool == "list":
                return "\n".join(self.ws.list(action.text() or ".")) or "(empty)", False
            if action.tool == "exec":
                result = await asyncio.to_thread(self.ws.run, action.text(), self._remaining())
                self._remaining()
                return result.describe(), False
            if action.tool == "test":
                scope = action.text().strip()
                if not scope:
                    return self._report(await self._check()), False
                return self._report(await self._check(self.task.scoped(scope))), False
            if action.tool == "delegate":
                return await self._delegate(action.text(), agent), False
        except ToolError as exc:
            return f"error: {exc}", False
        raise AssertionError(f"unhandled tool {action.tool}")

    async def _delegate(self, subtask: str, agent: str) -> str:
        if agent != "main":
            return "error: a sub-agent cannot delegate"
        if self.delegations >= self.cfg.max_delegations:
            return f"error: delegation budget ({self.cfg.max_delegations}) spent"
        self.delegations += 1
        sub = f"sub{self.delegations}"
        subtask = truncate_utf8(subtask, self.cfg.subtask_bytes)
        intro = self._intro(SUBAGENT_TEXT, self.task.spec, "subtask: " + subtask)
        message = await self._agent(sub, "subagent", intro, self.cfg.subagent_turns)
        return f"{sub}: {message}"

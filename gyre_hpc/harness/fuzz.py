"""Run hostile model output (``fuzz_cases``) through the harness's own code; say what became of it.

Why the real code and not a model of it: a fuzzer of a copy finds the copy's bugs. Every turn of
every case is decoded by ``actions.parse_action``, the function ``AgentRun`` calls on each
completion. The executed cases are the completions of a scripted ``ModelClient`` that drives real
``AgentRun``s: the loop's dispatch, ``Workspace``'s opens beneath the workspace fd, the jail for
commands, the journal, the checker that scores each run. The client reads each call's fate from
the next prompt (the tool result the loop shows the model), so nothing in the harness is patched.

An **escape** is an exception out of ``parse_action`` or out of ``AgentRun.run`` (either would take
down the rollout step that called it), or a run that ends ``failed`` although its client never
raised: a model-written call then raised inside the loop, which must instead reach the model as a
tool error. Besides, nothing under the fuzz root may change outside the runs' own workspaces and
journals: a bait directory there is what every path trick and symlink aims at.

Statuses of an executed call (``call_status``), read from the result text the loop shows:
``ok``, ``refused`` (a ToolError: ``error: ...``), ``default_action`` (not a call: appended to the
answer file), ``finished``, ``delegated``, ``exit_nonzero``, ``truncated`` (output capped or a
flood stopped), ``timeout``, ``unshown`` (it ran but no prompt showed its result: a sub-agent's
last turn), ``escaped``. Every run ends with one of the loop's statuses and a score.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc.harness.actions import format_action, marker_ids, parse_action
from gyre_hpc.harness.beneath import remove_tree
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.confine import Limits
from gyre_hpc.harness.fuzz_cases import BAIT, MILLION_LINES, FuzzCase, Ids, Marker, Turn
from gyre_hpc.harness.loop import SUMMARY_REQUEST, AgentRun, HarnessConfig
from gyre_hpc.harness.tasks import Task, TaskTest
from gyre_hpc.harness.tokenizer import ChatFormat
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer

FUZZ_TASK = Task(
    task_id="fuzz",
    spec="Hostile tool calls.",
    tests=(TaskTest("answer_exists", "import os\nassert os.path.isfile('answer.txt')"),),
    files={"README.md": "# fuzz\n", "src/a.py": "x = 1\n"},
    max_turns=100_000,     # runs end when the client runs out of cases and finishes
)
# A model's output is at most max_new_tokens, so the budget must admit a megabyte; context_limit
# is past what a run of 16 cases reaches, so contexts are never compressed; tool_output_bytes
# shows whole results (a command's trailer, "[exit N]", comes after its 4 KiB of output).
FUZZ_CONFIG = HarnessConfig(max_new_tokens=1 << 21, context_limit=1 << 23, run_timeout_s=600.0,
                            tool_output_bytes=1 << 14, command_limits=Limits(wall_s=5.0))
_RESPONSE_START, _RESPONSE_END = "<tool_response>\n", "\n</tool_response>"


@dataclass
class CaseOutcome:
    index: int
    kind: str
    variant: str
    executed: bool
    tools: list[str] = field(default_factory=list)      # parse_action's tool per turn ("answer": default action)
    statuses: list[str] = field(default_factory=list)   # per turn, executed cases only (call_status)
    run_status: str | None = None
    reward: float | None = None
    escaped: str | None = None       # where, and the exception, when one escaped
    unexpected: str | None = None    # the last turn did not become what the case expects


@dataclass
class FuzzResult:
    outcomes: list[CaseOutcome]
    runs: list[tuple[str, float]]    # (status, reward) of each executed run
    written_outside: list[str]       # paths under the fuzz root that changed outside the runs' own
    parse_s: dict[str, float]        # parse-only wall seconds by kind
    execute_s: float


def turn_ids(turn: Turn, tok: ChatTokenizer, bait: str) -> list[int]:
    ids: list[int] = []
    for seg in turn:
        if isinstance(seg, Marker):
            ids += marker_ids(tok, seg.marker)
        elif isinstance(seg, Ids):
            ids += seg.ids
        else:
            ids += tok.encode(seg.text.replace(BAIT, bait)) * seg.times
    return ids


def call_status(tool: str, result: str) -> str:
    """What became of one call, from the tool result text the loop shows the model."""
    if tool == "finish":
        return "finished"
    if result.startswith("error: "):
        return "refused"
    if tool == "answer":
        return "default_action"
    if tool == "delegate":
        return "delegated"
    if tool == "exec":
        if result.endswith("[killed: wall-clock timeout]"):
            return "timeout"
        if "\n[output truncated]" in result[-40:]:
            return "truncated"
        return "ok" if result.endswith("\n[exit 0]") else "exit_nonzero"
    return "ok"


@dataclass
class _Turn:
    case: CaseOutcome
    k: int
    ids: list[int]
    tool: str


class _FuzzClient:
    """The model of one run: each call answered with the next queued turn; after ``cap`` turns
    (at a case boundary) or when the queue is empty, ``finish`` until the run ends."""

    def __init__(self, queue: deque[_Turn], tok: ChatTokenizer, cap: int) -> None:
        self.queue, self.tok, self.cap = queue, tok, cap
        chat = ChatFormat(tok)
        self.summary_tail = chat.message("user", SUMMARY_REQUEST) + chat.generation_prompt()
        self.finish = format_action("finish", tokenizer=tok)
        self.issued: list[_Turn] = []
        self.pending: dict[str, tuple[_Turn, int]] = {}    # agent -> its last turn, where its prompt ended
        self.closing = False

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main") -> Completion:
        prompt = list(prompt)
        self.settle(agent, prompt)
        if prompt[-len(self.summary_tail):] == self.summary_tail:
            out = self.tok.encode("summary") + [self.tok.eos_id]
        else:
            self.closing = self.closing or not self.queue or (len(self.issued) >= self.cap and self.queue[0].k == 0)
            if self.closing:
                out = self.finish
            else:
                turn = self.queue.popleft()
                self.issued.append(turn)
                self.pending[agent] = (turn, len(prompt))
                out = turn.ids
        return Completion(tuple(out), (0.0,) * len(out))

    def settle(self, agent: str, prompt: list[int] | None) -> None:
        """Record the fate of ``agent``'s last turn from ``prompt`` (None: the run has ended)."""
        if agent not in self.pending:
            return
        turn, start = self.pending.pop(agent)
        end = start + len(turn.ids)
        if turn.tool == "finish":
            status = "finished"
        elif prompt is not None and len(prompt) > end and prompt[start:end] == turn.ids:
            text = self.tok.decode(prompt[end:], skip_special_tokens=False)
            result = text.split(_RESPONSE_START, 1)[-1].rsplit(_RESPONSE_END, 1)[0]
            status = call_status(turn.tool, result)
        else:
            status = "unshown"
        turn.case.statuses[turn.k] = status


async def _execute(turns: list[_Turn], root: Path, tok: ChatTokenizer, turns_per_run: int) -> list[tuple[str, float]]:
    queue, runs = deque(turns), []
    while queue:
        k = len(runs)
        ws, journal = root / "workspaces" / f"run-{k}", root / "journals" / f"run-{k}.journal"
        client = _FuzzClient(queue, tok, turns_per_run)
        status, reward, error = "escaped", 0.0, None
        try:
            result = await AgentRun(FUZZ_TASK, ws, client, journal, FUZZ_CONFIG, run_id=f"fuzz-{k}", tokenizer=tok).run(resume=False)
            status, reward = result.status, result.reward
            if result.status == "failed":       # the client never raises: a call (or the checker) did
                error = f"run failed: {result.error}"
        except Exception as exc:  # noqa: BLE001 - what the fuzzer is here to catch
            error = f"AgentRun.run raised {type(exc).__name__}: {exc}"
        for agent in list(client.pending):
            client.settle(agent, None)
        if error and client.issued:
            culprit = client.issued[-1]          # the loop acts on each output before asking for the next
            culprit.case.statuses[culprit.k] = "escaped"
            culprit.case.escaped = error[:300]
        for turn in client.issued:
            turn.case.run_status, turn.case.reward = status, reward
        runs.append((status, reward))
        if ws.exists():
            remove_tree(ws)
        journal.unlink(missing_ok=True)
        if not client.issued and queue:          # nothing consumed: the queue would never drain
            raise RuntimeError("a fuzz run issued no turn")
    return runs


def _tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: type and mode, and for the rest size, mtime and content hash
    (a directory's own mtime moves with its runs' entries, which are each listed anyway)."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if p.is_dir() and not p.is_symlink():
                state[str(p.relative_to(root))] = (st.st_mode,)
                continue
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            state[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return state


def _expectation(case: FuzzCase, out: CaseOutcome) -> str | None:
    if case.expect_tool is not None and out.tools[-1] != case.expect_tool:
        return f"parsed as {out.tools[-1]!r}, expected {case.expect_tool!r}"
    last = out.statuses[-1] if out.executed else None
    # "unshown" cannot be checked: the turn was a sub-agent's last, its result shown to no one.
    if out.executed and case.expect_status is not None and last not in (case.expect_status, "unshown", "escaped"):
        return f"became {last!r}, expected {case.expect_status!r}"
    return None


def run_cases(cases: list[FuzzCase], workdir: str | Path, tokenizer: ChatTokenizer | None = None,
              turns_per_run: int = 16) -> FuzzResult:
    """Parse every case; execute the ``execute`` ones, ``turns_per_run`` turns to a run, under
    ``workdir`` (made empty here; it holds the bait, the runs' workspaces and journals)."""
    tok = tokenizer or embedded_tokenizer()
    root = Path(workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise FileExistsError(f"fuzz workdir {root} is not empty")
    for sub in ("bait/dir", "workspaces", "journals"):
        (root / sub).mkdir(parents=True)
    (root / "bait/secret.txt").write_text("secret\n")
    (root / "bait/dir/keep.txt").write_text("keep\n")
    bait = str(root / "bait")
    before = _tree_state(root)

    outcomes, turns, parse_s = [], [], Counter()
    for case in cases:
        out = CaseOutcome(case.index, case.kind, case.variant, case.execute,
                          statuses=["not_run"] * len(case.turns) if case.execute else [])
        outcomes.append(out)
        for k, turn in enumerate(case.turns):
            ids = turn_ids(turn, tok, bait)
            start = time.perf_counter()
            try:
                tool = parse_action(ids, tok).tool
            except Exception as exc:  # noqa: BLE001 - an escape is a finding, not a crash of the fuzzer
                tool, out.escaped = "escaped", f"parse_action raised {type(exc).__name__}: {exc}"[:300]
            if not case.execute:
                parse_s[case.kind] += time.perf_counter() - start
            out.tools.append(tool)
            if case.execute:
                turns.append(_Turn(out, k, ids, tool))

    start = time.perf_counter()
    runs = asyncio.run(_execute(turns, root, tok, turns_per_run)) if turns else []
    execute_s = time.perf_counter() - start
    after = _tree_state(root)
    outside = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    for case, out in zip(cases, outcomes):
        out.unexpected = _expectation(case, out)
    return FuzzResult(outcomes, runs, outside, dict(parse_s), execute_s)


def summarize(result: FuzzResult) -> dict:
    """The figures ``gyre-hpc bench fuzz`` prints: outcomes by status and by kind, escapes."""
    outs = result.outcomes
    executed = [o for o in outs if o.executed]
    escaped = [o for o in outs if o.escaped]
    unexpected = [o for o in outs if o.unexpected]
    by_kind = {}
    for o in outs:
        k = by_kind.setdefault(o.kind, {"cases": 0, "executed": 0, "parsed": Counter(), "call_status": Counter()})
        k["cases"] += 1
        k["executed"] += o.executed
        k["parsed"].update(o.tools)
        k["call_status"].update(o.statuses)
    parse_only = Counter(o.kind for o in outs if not o.executed)
    hostile_s = sum(s for kind, s in result.parse_s.items() if kind != "well_formed")
    hostile_n = sum(n for kind, n in parse_only.items() if kind != "well_formed")
    well_ms = 1e3 * result.parse_s.get("well_formed", 0.0) / max(parse_only["well_formed"], 1)
    hostile_ms = 1e3 * hostile_s / max(hostile_n, 1)
    return {
        "cases": len(outs),
        "escaped": len(escaped),
        "escaped_cases": [{"index": o.index, "kind": o.kind, "variant": o.variant, "error": o.escaped} for o in escaped[:10]],
        "written_outside": result.written_outside,
        "unexpected": len(unexpected),
        "unexpected_cases": [{"index": o.index, "kind": o.kind, "variant": o.variant, "why": o.unexpected}
                             for o in unexpected[:10]],
        "parsed": dict(Counter(t for o in outs for t in o.tools)),
        "executed": {
            "cases": len(executed),
            "turns": sum(len(o.statuses) for o in executed),
            "runs": len(result.runs),
            "run_status": dict(Counter(s for s, _ in result.runs)),
            "mean_reward": sum(r for _, r in result.runs) / len(result.runs) if result.runs else None,
            "call_status": dict(Counter(s for o in executed for s in o.statuses)),
            "million_line_outputs": sum(o.variant in MILLION_LINES and o.statuses[-1] == "truncated" for o in executed),
        },
        "by_kind": {kind: {**v, "parsed": dict(v["parsed"]), "call_status": dict(v["call_status"])}
                    for kind, v in by_kind.items()},
        "parse_ms_per_case": {"well_formed": well_ms, "hostile": hostile_ms,
                              "ratio_hostile_over_well_formed": hostile_ms / well_ms if well_ms else None},
        "execute_s": result.execute_s,
    }

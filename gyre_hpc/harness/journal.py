"""The run journal: every model call of one run, appended to disk as it happens.

Format: JSON lines, one record per line, each ``write`` + ``fsync``'d before the harness
acts on the call, so what the journal holds is never ahead of nor behind what the agent did
by more than the call in flight:
  {"type": "run", "run_id", "task_id", "format": 1}                        first line
  {"type": "call", "role", "agent", "policy_version", "prompt", "output", "logprobs"}
  {"type": "end", "status", "reward", "wall_s", "passed"}                  last line, once
Why JSON lines: appends are atomic enough to reason about (a crash tears at most the last
line), a torn last line is recognisable (no newline or not JSON) and ignored, and people
can read a journal with ``head``. Logprobs are float32 values written as Python floats,
which round-trip exactly.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from gyre_hpc.trees.model import STATUSES, ModelCall

FORMAT = 1


class JournalError(ValueError):
    """A journal that cannot be trusted; the message names the file and line."""


@dataclass
class JournalState:
    path: Path
    run_id: str
    task_id: str
    calls: list[ModelCall] = field(default_factory=list)
    status: str = "running"       # "running" (no end record yet) or one of STATUSES
    reward: float | None = None
    wall_s: float | None = None
    passed: list[bool] | None = None
    torn_bytes: int = 0           # bytes of a torn last line that load ignored

    @property
    def finished(self) -> bool:
        return self.status != "running"


def _call_record(call: ModelCall) -> dict:
    return {"type": "call", "role": call.role, "agent": call.agent, "policy_version": call.policy_version,
            "prompt": call.prompt.tolist(), "output": call.output.tolist(),
            "logprobs": [float(x) for x in call.logprobs]}


def load_journal(path: str | Path) -> JournalState:
    """Read a journal; a torn last line is skipped (and counted), any other damage is an error."""
    p = Path(path)
    if not p.is_file():
        raise JournalError(f"journal {p} does not exist")
    raw = p.read_bytes()
    lines = raw.split(b"\n")
    tail = lines.pop()           # b"" when the file ends with a newline
    records: list[dict] = []
    torn = len(tail)
    for n, line in enumerate(lines, start=1):
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or "type" not in rec:
                raise ValueError("not a record")
        except ValueError as exc:
            if n == len(lines) and not tail:
                # a newline made it to disk but the record did not parse: still the torn tail
                torn = len(line) + 1
                break
            raise JournalError(f"journal {p} line {n} is damaged ({exc}); only the last line may be torn") from None
        records.append(rec)
    if not records or records[0].get("type") != "run":
        raise JournalError(f"journal {p} does not start with a run record")
    head = records[0]
    state = JournalState(p, str(head.get("run_id", "")), str(head.get("task_id", "")), torn_bytes=torn)
    for n, rec in enumerate(records[1:], start=2):
        if state.finished:
            raise JournalError(f"journal {p} line {n}: a record after the end record")
        if rec["type"] == "call":
            try:
                state.calls.append(ModelCall(rec["prompt"], rec["output"], rec["logprobs"], role=rec["role"],
                                             agent=rec["agent"], policy_version=int(rec["policy_version"])))
            except (KeyError, ValueError, TypeError) as exc:
                raise JournalError(f"journal {p} line {n}: bad call record ({exc})") from None
        elif rec["type"] == "end":
            if rec.get("status") not in STATUSES:
                raise JournalError(f"journal {p} line {n}: status {rec.get('status')!r} is not one of {STATUSES}")
            state.status = rec["status"]
            state.reward = float(rec["reward"])
            state.wall_s = float(rec["wall_s"])
            state.passed = list(rec.get("passed") or [])
        else:
            raise JournalError(f"journal {p} line {n}: unknown record type {rec['type']!r}")
    return state


class JournalWriter:
    """Appends records with fsync. ``open`` creates a journal or continues an unfinished one."""

    def __init__(self, path: Path, fh) -> None:
        self.path = path
        self._fh = fh

    @classmethod
    def create(cls, path: str | Path, run_id: str, task_id: str) -> "JournalWriter":
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        w = cls(p, open(p, "wb"))
        w._append({"type": "run", "run_id": run_id, "task_id": task_id, "format": FORMAT})
        return w

    @classmethod
    def reopen(cls, state: JournalState) -> "JournalWriter":
        """Continue an unfinished journal: cut its torn tail first so appends start on a line."""
        if state.finished:
            raise JournalError(f"journal {state.path} already ended with status {state.status!r}")
        fh = open(state.path, "r+b")
        if state.torn_bytes:
            fh.truncate(os.path.getsize(state.path) - state.torn_bytes)
        fh.seek(0, os.SEEK_END)
        return cls(state.path, fh)

    def _append(self, record: dict) -> None:
        self._fh.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def append_call(self, call: ModelCall) -> None:
        self._append(_call_record(call))

    def end(self, status: str, reward: float, wall_s: float, passed: list[bool]) -> None:
        if status not in STATUSES:
            raise ValueError(f"status {status!r}: valid statuses are {', '.join(STATUSES)}")
        self._append({"type": "end", "status": status, "reward": float(reward), "wall_s": float(wall_s),
                      "passed": [bool(x) for x in passed]})
        self.close()

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

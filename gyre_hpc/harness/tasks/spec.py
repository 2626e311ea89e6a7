"""What a task is: the text the model sees, the files it starts from, the tests that score it."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from gyre_hpc.harness.beneath import remove_tree
from gyre_hpc.harness.tools import ToolError


@dataclass(frozen=True)
class TaskTest:
    """One check: Python run in the workspace directory; it passes when it raises nothing."""

    name: str
    code: str


@dataclass(frozen=True)
class Task:
    task_id: str
    spec: str
    tests: tuple[TaskTest, ...]
    files: dict[str, str] = field(default_factory=dict)
    answer_file: str = "answer.txt"   # where the default action (unparseable output) appends
    max_turns: int = 12               # main-agent model calls before the run ends (summaries excluded)
    report_failures: int | None = None   # failing tests a test report lists (None: all)

    def __post_init__(self) -> None:
        if not self.tests:
            raise ValueError(f"task {self.task_id!r} has no tests: its score would be undefined")
        names = [t.name for t in self.tests]
        if len(set(names)) != len(names):
            raise ValueError(f"task {self.task_id!r} has duplicate test names: {names}")
        if self.max_turns < 1:
            raise ValueError(f"task {self.task_id!r}: max_turns={self.max_turns} must be >= 1")

    def scoped(self, scope: str) -> "Task":
        """The task with only the tests named ``scope`` or ``scope/...`` (``test`` with a scope,
        as ``pytest p1/`` runs one package's tests); a scope no test matches is a ToolError."""
        prefix = scope.rstrip("/")
        tests = tuple(t for t in self.tests if t.name == prefix or t.name.startswith(prefix + "/"))
        if not tests:
            raise ToolError(f"no test is named {prefix!r} or {prefix + '/...'!r}")
        return replace(self, tests=tests)

    def materialize(self, workspace: str | Path) -> Path:
        """Reset ``workspace`` to the task's initial files (a replayed run starts from here too)."""
        ws = Path(workspace)
        if ws.exists():
            remove_tree(ws)  # iterative: a model-built 3,000-deep chain must not crash the reset
        ws.mkdir(parents=True)
        for rel, text in self.files.items():
            p = ws / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return ws

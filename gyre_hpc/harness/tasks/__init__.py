"""Tasks: a spec, initial files and tests; ``load_suite`` picks a built-in suite by name."""
from __future__ import annotations

from gyre_hpc.harness.tasks.builtin import SUITES
from gyre_hpc.harness.tasks.checker import CheckReport, check_workspace
from gyre_hpc.harness.tasks.spec import Task, TaskTest

__all__ = ["CheckReport", "Task", "TaskTest", "check_workspace", "load_suite", "suite_names"]


def suite_names() -> list[str]:
    return sorted(SUITES)


def load_suite(name: str, field: str = "rollout.tasks") -> list[Task]:
    """The tasks of suite ``name``; ``field`` is the config field that named it, so that an
    unknown name is refused by the field the user wrote (``rollout.tasks``, ``warmstart.tasks``)."""
    if name not in SUITES:
        raise ValueError(f"{field}={name!r} is not a task suite; valid suites: {', '.join(suite_names())}")
    return list(SUITES[name])

"""Tasks: a spec, initial files and tests; ``load_suite`` picks a built-in suite by name or
loads a directory of tasks (``files.py``)."""
from __future__ import annotations

from pathlib import Path

from gyre_hpc.harness.tasks.builtin import SUITES
from gyre_hpc.harness.tasks.checker import CheckReport, check_workspace, score_workspace
from gyre_hpc.harness.tasks.files import TaskFileError, load_task_dir, write_task_dir
from gyre_hpc.harness.tasks.spec import Task, TaskTest

__all__ = ["CheckReport", "Task", "TaskFileError", "TaskTest", "builtin_task", "check_workspace", "is_task_dir", "score_workspace",
           "load_suite", "load_task_dir", "suite_names", "write_task_dir"]


def suite_names() -> list[str]:
    return sorted(SUITES)


def is_task_dir(value: str) -> bool:
    """Whether a ``rollout.tasks`` value names a directory of tasks rather than a suite: it holds a
    '/' or is a directory here. A built-in suite's name is never one (it is looked up first)."""
    return value not in SUITES and ("/" in value or Path(value).is_dir())


def load_suite(name: str, field: str = "rollout.tasks") -> list[Task]:
    """The tasks of suite ``name`` or of the task directory it names; ``field`` is the config
    field that named it, so that an unknown name is refused by the field the user wrote
    (``rollout.tasks``, ``warmstart.tasks``)."""
    if name in SUITES:
        return list(SUITES[name])
    if is_task_dir(name):
        return load_task_dir(name, field)
    raise ValueError(f"{field}={name!r} is not a task suite; valid suites: {', '.join(suite_names())}; "
                     f"or a directory of tasks (a path with a '/', e.g. ./{name})")


def builtin_task(task_id: str) -> Task | None:
    """The built-in task with id ``task_id``, if any: what a task's teacher playbook was written for."""
    return next((t for suite in SUITES.values() for t in suite if t.task_id == task_id), None)

"""Task suites from files: a directory with one folder per task (``rollout.tasks: PATH``).

::

    tasks/
      suite.yaml          optional: {tasks: [folder, ...]}, the suite's order (default: sorted)
      add-two/
        task.yaml         id (default: the folder's name), prompt, turn_budget, answer_file,
                          report_failures, tests (optional: the order the tests run in)
        files/            the workspace's initial files, copied as they are
        tests/            one Python file per test; ``tests/p1/m04.py`` is the test ``p1/m04``

A test file is exactly a built-in ``TaskTest``'s code: the checker runs it in its judge, the
workspace's modules behind proxies, and it passes when it raises nothing. There is no "check
command": a command that runs the workspace's code lets that code decide its own verdict
(``os._exit(0)`` before the assertion), which is what the judge exists to prevent.

Why the orders are written down: the rl workload picks a step's tasks by index and a report
lists the first failing test, so a suite's meaning depends on both orders; a directory listing
has none, and sorted names are not the built-in suites' orders (``xlong`` reports a package's
test after its modules). ``write_task_dir`` writes an order only where it differs from sorted,
so a built-in suite written out loads back equal, task for task.

Why files are read as bytes and decoded strictly: a ``Task`` holds text, and a newline
translated or a byte replaced on the way in would be a different task under the same name
(the warm-start key hashes the tasks' contents).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gyre_hpc.harness.tasks.spec import Task, TaskTest

SPEC_FILE = "task.yaml"
SUITE_FILE = "suite.yaml"
FILES_DIR = "files"
TESTS_DIR = "tests"
TEST_SUFFIX = ".py"
# A task id or a test name is a folder or a file name (its '/' a subfolder): no empty part,
# no '.' or '..', no leading dot (hidden folders, such as .git, are not tasks).
_NAME_PART = re.compile(r"^[^/.\x00][^/\x00]*$")


class TaskFileError(ValueError):
    """A task directory that cannot be loaded; the message names the file and the field."""


class TaskSpec(BaseModel):
    """``task.yaml``. Strict: ``turn_budget: "6"`` is a wrong type, not a six."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(None, min_length=1, description="the task's id (default: its folder's name)")
    prompt: str = Field(min_length=1, description="what the model is asked (the first user turn)")
    turn_budget: int = Field(ge=1, description="main-agent model calls before the run ends (Task.max_turns)")
    answer_file: str = Field("answer.txt", min_length=1, description="where output that is no tool call goes")
    report_failures: int | None = Field(None, ge=0, description="failing tests a report lists (null: all)")
    tests: list[str] | None = Field(None, description="the tests' order (default: their names sorted)")


class SuiteSpec(BaseModel):
    """``suite.yaml``: the order of the suite's tasks (their folders)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tasks: list[str]


def _valid_name(name: str) -> bool:
    return bool(name) and all(_NAME_PART.match(part) for part in name.split("/"))


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TaskFileError(f"{path}: not UTF-8 text (byte {exc.start}); a task's files and tests are text") from None


def _read_yaml(path: Path, model: type[BaseModel]) -> BaseModel:
    try:
        data = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as exc:
        raise TaskFileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TaskFileError(f"{path}: must be a mapping of fields ({', '.join(model.model_fields)})")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise TaskFileError(f"{path}: " + "; ".join(_field_error(e, model) for e in exc.errors())) from None


def _field_error(err: dict, model: type[BaseModel]) -> str:
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "missing":
        return f"{where}: required"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown field; valid fields: {', '.join(model.model_fields)}"
    return f"{where}: {err['msg']}"


def _plain_files(top: Path) -> dict[str, Path]:
    """Every regular file under ``top`` by its '/'-separated relative path; a link is refused
    (what it points at is not part of the task, and may differ where the suite is read)."""
    if top.is_symlink():
        raise TaskFileError(f"{top}: a link; a task holds plain files and folders")
    found: dict[str, Path] = {}
    for folder, dirs, names in os.walk(top):
        dirs.sort()
        for name in sorted(dirs + names):
            path = Path(folder) / name
            if path.is_symlink():
                raise TaskFileError(f"{path}: a link; a task holds plain files and folders")
        for name in sorted(names):
            path = Path(folder) / name
            if not path.is_file():
                raise TaskFileError(f"{path}: not a regular file")
            found[path.relative_to(top).as_posix()] = path
    return found


def _tests(folder: Path, spec: TaskSpec, spec_path: Path) -> tuple[TaskTest, ...]:
    top = folder / TESTS_DIR
    if not top.is_dir():
        raise TaskFileError(f"{folder}: no {TESTS_DIR}/ folder: a task without tests has no score "
                            f"(one Python file per test, {TESTS_DIR}/<name>{TEST_SUFFIX})")
    by_name: dict[str, Path] = {}
    for rel, path in _plain_files(top).items():
        if "__pycache__" in rel.split("/"):
            continue
        if not rel.endswith(TEST_SUFFIX):
            raise TaskFileError(f"{path}: not a test; a test is a Python file ({TESTS_DIR}/<name>{TEST_SUFFIX})")
        by_name[rel.removesuffix(TEST_SUFFIX)] = path
    if not by_name:
        raise TaskFileError(f"{top}: holds no test ({TESTS_DIR}/<name>{TEST_SUFFIX}): a task without tests has no score")
    order = sorted(by_name) if spec.tests is None else spec.tests
    if spec.tests is not None:
        unknown = [n for n in spec.tests if n not in by_name]
        if unknown:
            raise TaskFileError(f"{spec_path}: tests: {unknown[0]!r} has no file {TESTS_DIR}/{unknown[0]}{TEST_SUFFIX}")
        if len(set(spec.tests)) != len(spec.tests):
            twice = next(n for n in spec.tests if spec.tests.count(n) > 1)
            raise TaskFileError(f"{spec_path}: tests: {twice!r} is listed twice")
        unlisted = sorted(set(by_name) - set(spec.tests))
        if unlisted:
            raise TaskFileError(f"{spec_path}: tests: {TESTS_DIR}/{unlisted[0]}{TEST_SUFFIX} is not listed "
                                f"(list every test, or drop the field to run them all in sorted order)")
    return tuple(TaskTest(name, _read_text(by_name[name])) for name in order)


def load_task(folder: str | Path) -> Task:
    """One task folder (``task.yaml``, ``files/``, ``tests/``) as a ``Task``."""
    folder = Path(folder)
    spec_path = folder / SPEC_FILE
    if not spec_path.is_file():
        raise TaskFileError(f"{folder}: no {SPEC_FILE}; every folder of a task directory is a task "
                            f"({SPEC_FILE}, {FILES_DIR}/, {TESTS_DIR}/)")
    spec = _read_yaml(spec_path, TaskSpec)
    tests = _tests(folder, spec, spec_path)
    files_dir = folder / FILES_DIR
    if files_dir.exists() and not files_dir.is_dir():
        raise TaskFileError(f"{files_dir}: must be a folder of the workspace's initial files")
    files = {rel: _read_text(p) for rel, p in _plain_files(files_dir).items()} if files_dir.is_dir() else {}
    extra = sorted(p.name for p in folder.iterdir() if p.name not in (SPEC_FILE, FILES_DIR, TESTS_DIR))
    if extra:
        raise TaskFileError(f"{folder / extra[0]}: not part of a task; a task folder holds {SPEC_FILE}, "
                            f"{FILES_DIR}/ and {TESTS_DIR}/")
    try:
        return Task(task_id=spec.id if spec.id is not None else folder.name, spec=spec.prompt, tests=tests,
                    files=files, answer_file=spec.answer_file, max_turns=spec.turn_budget,
                    report_failures=spec.report_failures)
    except ValueError as exc:
        raise TaskFileError(f"{spec_path}: {exc}") from None


def load_task_dir(path: str | Path, field: str = "rollout.tasks") -> list[Task]:
    """The suite in directory ``path``, in its order (``suite.yaml``, else sorted folders);
    ``field`` is the config field that named it, for the errors about the directory itself."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise TaskFileError(f"{field}={str(path)!r}: no such directory "
                            f"({'a file' if root.exists() else 'nothing'} there; a task directory holds a folder per task)")
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if (root / SUITE_FILE).is_file():
        order = _read_yaml(root / SUITE_FILE, SuiteSpec).tasks
        unknown = [n for n in order if n not in folders]
        if unknown:
            raise TaskFileError(f"{root / SUITE_FILE}: tasks: {unknown[0]!r} is not a folder of {root}")
        if len(set(order)) != len(order) or sorted(order) != folders:
            missing = sorted(set(folders) - set(order))
            raise TaskFileError(f"{root / SUITE_FILE}: tasks: must list each task folder once"
                                + (f" ({missing[0]!r} is not listed)" if missing else " (one is listed twice)"))
        folders = order
    if not folders:
        raise TaskFileError(f"{field}={str(path)!r}: holds no task (a task is a folder with a {SPEC_FILE}, "
                            f"{FILES_DIR}/ and {TESTS_DIR}/)")
    tasks = [load_task(root / name) for name in folders]
    seen: dict[str, str] = {}
    for name, task in zip(folders, tasks):
        if task.task_id in seen:
            raise TaskFileError(f"{root / name / SPEC_FILE}: id: {task.task_id!r} is also the id of "
                                f"{root / seen[task.task_id]}")
        seen[task.task_id] = name
    return tasks


def _literal_blocks(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # A multi-line prompt reads as written (``|``); PyYAML falls back to quoting by itself
    # where a block cannot hold the text exactly (trailing spaces).
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


class _SpecDumper(yaml.SafeDumper):
    pass


_SpecDumper.add_representer(str, _literal_blocks)


def _dump(data: dict) -> str:
    return yaml.dump(data, Dumper=_SpecDumper, sort_keys=False, allow_unicode=True, width=1 << 16)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def write_task(task: Task, folder: str | Path) -> Path:
    """``task`` as a task folder (which must not exist yet) that ``load_task`` reads back equal."""
    folder = Path(folder)
    for kind, names in (("test name", [t.name for t in task.tests]), ("file", list(task.files))):
        bad = [n for n in names if not _valid_name(n)]
        if bad:
            raise TaskFileError(f"task {task.task_id!r}: {kind} {bad[0]!r} cannot be a path inside its folder")
    folder.mkdir(parents=True)
    spec: dict = {"id": task.task_id, "prompt": task.spec, "turn_budget": task.max_turns}
    if task.answer_file != "answer.txt":
        spec["answer_file"] = task.answer_file
    if task.report_failures is not None:
        spec["report_failures"] = task.report_failures
    names = [t.name for t in task.tests]
    if names != sorted(names):
        spec["tests"] = names
    _write(folder / SPEC_FILE, _dump(spec))
    for test in task.tests:
        _write(folder / TESTS_DIR / f"{test.name}{TEST_SUFFIX}", test.code)
    for rel, text in task.files.items():
        _write(folder / FILES_DIR / rel, text)
    return folder


def write_task_dir(tasks: list[Task] | tuple[Task, ...], path: str | Path) -> Path:
    """A suite as a task directory (``rollout.tasks: PATH``): a folder per task, named by its
    id, and ``suite.yaml`` where the suite's order is not the folders' sorted order."""
    root = Path(path)
    ids = [t.task_id for t in tasks]
    bad = [i for i in ids if not _valid_name(i) or "/" in i]
    if bad:
        raise TaskFileError(f"task id {bad[0]!r} cannot be a folder name")
    if len(set(ids)) != len(ids):
        raise TaskFileError(f"task ids must be unique to be folders: {ids}")
    # A new or empty directory only: a folder already there would join the suite unordered.
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise TaskFileError(f"{root}: exists and is not an empty directory; write a suite into a new one")
    root.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        write_task(task, root / task.task_id)
    if ids != sorted(ids):
        _write(root / SUITE_FILE, _dump({"tasks": ids}))
    return root

"""Task suites from files (``harness/tasks/files.py``): loading, the errors that name the file and
field, the built-in suites written out and read back equal, rewards from the real checker."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gyre_hpc.harness.tasks import (Task, TaskFileError, TaskTest, builtin_task, check_workspace, is_task_dir,
                                    load_suite, load_task_dir, write_task_dir)
from gyre_hpc.harness.tasks.files import load_task, write_task
from gyre_hpc.harness.tasks.longhorizon import PLAYBOOKS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tasks"


def _task_dir(root: Path, spec: str = "prompt: add\nturn_budget: 3\n", tests: dict | None = None,
              files: dict | None = None, name: str = "t1") -> Path:
    """A one-task directory under ``root``: ``spec`` as its task.yaml (None: none)."""
    folder = root / name
    folder.mkdir(parents=True)
    if spec is not None:
        (folder / "task.yaml").write_text(spec)
    for rel, text in (tests if tests is not None else {"ok.py": "pass\n"}).items():
        (folder / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / "tests" / rel).write_text(text)
    for rel, text in (files or {}).items():
        (folder / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / "files" / rel).write_text(text)
    return root


def test_the_example_task_directory_loads_with_its_files_tests_and_orders():
    tasks = load_suite(str(EXAMPLE))
    assert [t.task_id for t in tasks] == ["add-two", "word-count"]
    add, words = tasks
    assert add.files == {"calc.py": "def add(a, b):\n    return a - b\n"}
    assert [t.name for t in add.tests] == ["adds", "adds_negative", "imports"]      # sorted: no order given
    assert add.tests[0].code == "import calc\nassert calc.add(2, 3) == 5\n"
    assert (add.max_turns, add.answer_file, add.report_failures) == (6, "answer.txt", None)
    assert add.spec.startswith("calc.py's add(a, b) should return a + b")
    assert [t.name for t in words.tests] == ["module_exists", "empty", "sentence"]   # the spec's order
    assert (words.files, words.max_turns, words.report_failures) == ({}, 8, 1)


def test_a_value_is_a_task_directory_when_it_holds_a_slash_or_is_a_directory_and_no_suite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _task_dir(tmp_path / "mine")
    _task_dir(tmp_path / "long")              # a directory named like a built-in suite
    assert is_task_dir("./mine") and is_task_dir("mine") and is_task_dir("no/such")
    assert not is_task_dir("long") and not is_task_dir("nope")
    assert load_suite("long") == list(load_suite("long")) and load_suite("long")[0].task_id == "lh-stats"
    assert [t.task_id for t in load_suite("mine")] == ["t1"]
    with pytest.raises(ValueError, match=r"rollout.tasks='nope' is not a task suite; valid suites: builtin.*"
                                         r"or a directory of tasks \(a path with a '/', e.g. ./nope\)"):
        load_suite("nope")


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# Each way a task directory can be wrong, and the words its error must hold: the file, the field.
_BROKEN = {
    "missing_spec": (lambda r: _task_dir(r, spec=None), r"/t1: no task.yaml; every folder of a task directory"),
    "bad_type": (lambda r: _task_dir(r, "prompt: add\nturn_budget: '3'\n"),
                 r"/t1/task.yaml: turn_budget: Input should be a valid integer"),
    "budget_below_one": (lambda r: _task_dir(r, "prompt: add\nturn_budget: 0\n"),
                         r"/t1/task.yaml: turn_budget: Input should be greater than or equal to 1"),
    "missing_field": (lambda r: _task_dir(r, "turn_budget: 3\n"), r"/t1/task.yaml: prompt: required"),
    "unknown_field": (lambda r: _task_dir(r, "prompt: add\nturn_budget: 3\nturns: 4\n"),
                      r"/t1/task.yaml: turns: unknown field; valid fields: id, prompt, turn_budget, answer_file"),
    "not_a_mapping": (lambda r: _task_dir(r, "- prompt\n"), r"/t1/task.yaml: must be a mapping of fields"),
    "bad_yaml": (lambda r: _task_dir(r, "prompt: [add\n"), r"/t1/task.yaml: not valid YAML"),
    "missing_tests": (lambda r: _task_dir(r, tests={}), r"/t1: no tests/ folder: a task without tests has no score"),
    "empty_tests": (lambda r: (_task_dir(r, tests={}), (r / "t1" / "tests").mkdir()),
                    r"/t1/tests: holds no test"),
    "not_a_test": (lambda r: _task_dir(r, tests={"ok.py": "pass", "notes.txt": "x"}),
                   r"/t1/tests/notes.txt: not a test; a test is a Python file"),
    "unlisted_test": (lambda r: _task_dir(r, "prompt: a\nturn_budget: 3\ntests: [ok]\n", {"ok.py": "", "b.py": ""}),
                      r"/t1/task.yaml: tests: tests/b.py is not listed"),
    "unknown_test": (lambda r: _task_dir(r, "prompt: a\nturn_budget: 3\ntests: [ok, zz]\n"),
                     r"/t1/task.yaml: tests: 'zz' has no file tests/zz.py"),
    "stray_entry": (lambda r: (_task_dir(r), (r / "t1" / "test").mkdir()), r"/t1/test: not part of a task"),
    "not_utf8": (lambda r: (_task_dir(r), _write(r / "t1" / "files" / "a.bin", b"\xff\xfe")),
                 r"/t1/files/a.bin: not UTF-8 text \(byte 0\)"),
    "link": (lambda r: (_task_dir(r), (r / "t1" / "files").mkdir(), os.symlink("/etc/passwd", r / "t1/files/p")),
             r"/t1/files/p: a link; a task holds plain files"),
    "duplicate_id": (lambda r: (_task_dir(r, "id: same\nprompt: a\nturn_budget: 3\n"),
                                _task_dir(r, "id: same\nprompt: a\nturn_budget: 3\n", name="t2")),
                     r"/t2/task.yaml: id: 'same' is also the id of .*/t1"),
    "suite_order_misses_one": (lambda r: (_task_dir(r), _task_dir(r, name="t2"), _write(r / "suite.yaml", b"tasks: [t2]")),
                               r"/suite.yaml: tasks: must list each task folder once \('t1' is not listed\)"),
    "empty_dir": (lambda r: r.mkdir(), r"rollout.tasks='.*/suite': holds no task"),
    "no_dir": (lambda r: None, r"rollout.tasks='.*/suite': no such directory \(nothing there"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN))
def test_a_broken_task_directory_is_refused_naming_the_file_and_field(tmp_path, case):
    make, message = _BROKEN[case]
    make(tmp_path / "suite")
    with pytest.raises(TaskFileError, match=message):
        load_task_dir(tmp_path / "suite")


def test_the_config_field_that_named_a_directory_is_in_its_error(tmp_path):
    with pytest.raises(TaskFileError, match=r"^warmstart.tasks='.*/gone': no such directory"):
        load_suite(str(tmp_path / "gone"), "warmstart.tasks")


@pytest.mark.parametrize("suite", ["builtin", "long", "xlong-mini"])
def test_a_built_in_suite_written_as_files_loads_back_equal(tmp_path, suite):
    tasks = load_suite(suite)
    root = write_task_dir(tasks, tmp_path / suite)
    assert load_task_dir(root) == tasks            # every field, every test's code, the orders
    assert all(builtin_task(t.task_id) == t for t in load_task_dir(root))
    order = (root / "suite.yaml").exists()
    assert order == ([t.task_id for t in tasks] != sorted(t.task_id for t in tasks))   # written only when needed


def test_a_single_task_round_trips_its_optional_fields(tmp_path):
    task = Task("odd", "line one\nline two  \n", tests=(TaskTest("z", "pass"), TaskTest("a/b", "assert 1\n")),
                files={"pkg/__init__.py": "", "crlf.txt": "a\r\nb"}, answer_file="out.txt", max_turns=2,
                report_failures=0)
    assert load_task(write_task(task, tmp_path / "odd")) == task


def test_writing_refuses_what_cannot_be_a_folder_or_a_non_empty_target(tmp_path):
    with pytest.raises(TaskFileError, match=r"task id '\.\.' cannot be a folder name"):
        write_task_dir([Task("..", "s", tests=(TaskTest("a", "pass"),))], tmp_path / "a")
    with pytest.raises(TaskFileError, match=r"task 'x': file '\.\./up.py' cannot be a path inside its folder"):
        write_task(Task("x", "s", tests=(TaskTest("a", "pass"),), files={"../up.py": ""}), tmp_path / "x")
    write_task_dir(load_suite("repo"), tmp_path / "repo")
    with pytest.raises(TaskFileError, match=r"/repo: exists and is not an empty directory"):
        write_task_dir(load_suite("easy"), tmp_path / "repo")


def _apply(ws: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)


def test_a_known_solution_scores_the_same_through_the_built_in_task_and_its_files(tmp_path):
    task = next(t for t in load_suite("long") if t.task_id == "lh-stats")
    (from_files,) = load_task_dir(write_task_dir([task], tmp_path / "suite"))
    book = PLAYBOOKS["lh-stats"]
    right = {path: sol for path, _, sol in book.fixes} | {s.path: s.solution for s in book.subtasks}
    half = {path: wrong for path, wrong, _ in book.fixes}          # the teacher's wrong first fix, no median
    for solution in (right, half):
        reports = []
        for t, name in ((task, "builtin"), (from_files, "files")):
            ws = t.materialize(tmp_path / name)
            _apply(ws, solution)
            reports.append(check_workspace(t, ws))
        assert reports[0].passed == reports[1].passed and reports[0].names == reports[1].names
    assert reports[0].score == 1 / 7                                          # only `imports` passes on `half`


def test_a_file_task_is_scored_by_its_tests_in_a_real_workspace(tmp_path):
    (task, _) = load_suite(str(EXAMPLE))
    ws = task.materialize(tmp_path / "ws")
    assert (ws / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"
    start = check_workspace(task, ws)
    assert start.passed == (False, False, True) and start.score == 1 / 3      # the bug: only `imports` passes
    (ws / "calc.py").write_text("def add(a, b):\n    return abs(a) + abs(b)\n")   # wrong: right on 2 + 3 only
    wrong = check_workspace(task, ws)
    assert wrong.passed == (True, False, True)
    assert "FAIL adds_negative: AssertionError" in wrong.summary()
    (ws / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    assert check_workspace(task, ws).score == 1.0


def test_the_docs_worked_example_is_the_example_directory():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "harness.md").read_text()
    section = docs.split("### Tasks from files", 1)[1]
    yaml_block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    python_block = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert yaml_block == (EXAMPLE / "add-two" / "task.yaml").read_text()
    assert python_block == (EXAMPLE / "add-two" / "tests" / "adds.py").read_text()


def test_a_test_may_run_a_command_in_the_judge_and_assert_on_its_output(tmp_path):
    code = ("import subprocess\nr = subprocess.run(['python3', '-c', 'import calc; print(calc.add(2, 3))'],\n"
            "                   capture_output=True, text=True, timeout=10)\nassert r.stdout == '5\\n', r\n")
    root = _task_dir(tmp_path / "suite", tests={"cmd.py": code}, files={"calc.py": "def add(a, b):\n    return a + b\n"})
    (task,) = load_task_dir(root)
    ws = task.materialize(tmp_path / "ws")
    assert check_workspace(task, ws).score == 1.0
    (ws / "calc.py").write_text("def add(a, b):\n    return a * b\n")
    assert check_workspace(task, ws).score == 0.0

from __future__ import annotations

import pytest

from gyre_hpc.harness.confine import Limits
from gyre_hpc.harness.tasks import Task, TaskTest, check_workspace, load_suite, suite_names

REFERENCE = {
    "add-function": {"mathx.py": "def add(a, b):\n    return a + b\n"},
    "fix-bug": {"stats.py": "def mean(xs):\n    return sum(xs) / len(xs)\n"},
    "greet-package": {"greet/__init__.py": "VERSION = '1.0'\ndef hello(name):\n    return 'hello ' + name\n"},
    "fizzbuzz": {"fb.py": "def fizzbuzz(n):\n    s = ('Fizz' if n % 3 == 0 else '') + ('Buzz' if n % 5 == 0 else '')\n"
                          "    return s or str(n)\n"},
}


def test_unknown_suite_lists_the_valid_ones():
    with pytest.raises(ValueError, match="rollout.tasks='nope'.*builtin, easy, long, repo"):
        load_suite("nope")
    assert suite_names() == ["builtin", "easy", "long", "repo"]
    assert {t.task_id for t in load_suite("builtin")} == {t.task_id for t in load_suite("easy") + load_suite("repo")}


@pytest.mark.parametrize("task", load_suite("repo"), ids=lambda t: t.task_id)
def test_repo_task_scores_initial_workspace_low_and_reference_solution_full(task, tmp_path):
    ws = task.materialize(tmp_path / "ws")
    assert check_workspace(task, ws).score < 1.0
    for rel, text in REFERENCE[task.task_id].items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    report = check_workspace(task, ws)
    assert report.score == 1.0, report.summary()


@pytest.mark.parametrize("answer,score", [(None, 0.0), ("", 0.0), ("hello world, this is long", 0.5),
                                          ("ok", 0.75), ("7 apples", 0.75), ("ok 42\n", 1.0)])
def test_easy_task_gives_graded_partial_credit(tmp_path, answer, score):
    task = next(t for t in load_suite("easy") if t.task_id == "answer-short")
    ws = task.materialize(tmp_path / "ws")
    if answer is not None:
        (ws / "answer.txt").write_text(answer)
    assert check_workspace(task, ws).score == score


def test_checker_survives_hanging_and_spoofing_code(tmp_path):
    task = Task("t", "spec", tests=(TaskTest("first", "pass"),
                                    TaskTest("spoof", "import mod"),
                                    TaskTest("hang", "while True: pass"),
                                    TaskTest("after", "pass")))
    ws = task.materialize(tmp_path / "ws")
    # the module under test prints lines that look like results; they must not count
    (ws / "mod.py").write_text("import json\nfor n in ('hang', 'after'):\n"
                               "    print(json.dumps([n, True, '']))\nraise SystemExit(3)\n")
    report = check_workspace(task, ws, Limits(wall_s=2.0, cpu_s=2))
    assert report.passed == (True, False, False, False)
    assert "SystemExit" in report.reasons[1]
    assert report.score == 0.25


def test_task_validation_names_the_problem():
    with pytest.raises(ValueError, match="no tests"):
        Task("x", "s", tests=())
    with pytest.raises(ValueError, match="duplicate test names"):
        Task("x", "s", tests=(TaskTest("a", "pass"), TaskTest("a", "pass")))

from __future__ import annotations

import pytest

from gyre_hpc.harness.confine import Limits
from gyre_hpc.harness.tasks import Task, TaskTest, check_workspace, load_suite, score_workspace, suite_names

REFERENCE = {
    "add-function": {"mathx.py": "def add(a, b):\n    return a + b\n"},
    "fix-bug": {"stats.py": "def mean(xs):\n    return sum(xs) / len(xs)\n"},
    "greet-package": {"greet/__init__.py": "VERSION = '1.0'\ndef hello(name):\n    return 'hello ' + name\n"},
    "fizzbuzz": {"fb.py": "def fizzbuzz(n):\n    s = ('Fizz' if n % 3 == 0 else '') + ('Buzz' if n % 5 == 0 else '')\n"
                          "    return s or str(n)\n"},
}


def test_unknown_suite_lists_the_valid_ones():
    with pytest.raises(ValueError, match="rollout.tasks='nope'.*builtin, easy, long, repo, xlong, xlong-large, xlong-mini"):
        load_suite("nope")
    with pytest.raises(ValueError, match="^warmstart.tasks='nope' is not a task suite"):   # the field that named it
        load_suite("nope", "warmstart.tasks")
    assert suite_names() == ["builtin", "easy", "long", "repo", "xlong", "xlong-large", "xlong-mini"]
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


_ADD_TASK = Task("add", "write add", tests=(TaskTest("add_ints", "import mathx\nassert mathx.add(2, 3) == 5"),
                                           TaskTest("add_strs", "import mathx\nassert mathx.add('a', 'b') == 'ab'")))

# Three ways a module under test has tried to pass tests it fails: write the runner's result
# lines with its nonce, exit 0 before the assertion runs, return a value equal to anything.
_FORGERS = {
    "nonce": "import json, sys\nm = sys.modules['__main__']\nfor n, _ in getattr(m, 'TESTS', []):\n"
             "    m.results.write(m.NONCE + json.dumps([n, True, '']) + '\\n')\n"
             "getattr(m, 'results', sys.stdout).flush()\nimport os\nos._exit(0)\n",
    "exit0": "import os\nos._exit(0)\n",
    "always_equal": "class Any:\n    def __eq__(self, other):\n        return True\n"
                    "def add(a, b):\n    return Any()\n",
    "patch_builtins": "import builtins\nbuiltins.AssertionError = type('Quiet', (BaseException,), {})\n"
                      "import sys\nsys.modules['__main__'].__dict__['ok'] = True\ndef add(a, b):\n    return a - b\n",
}


@pytest.mark.parametrize("forger", sorted(_FORGERS))
def test_a_forging_module_scores_zero(tmp_path, forger):
    ws = _ADD_TASK.materialize(tmp_path / "ws")
    (ws / "mathx.py").write_text(_FORGERS[forger] + "def sub(a, b):\n    return a - b\n")
    report = check_workspace(_ADD_TASK, ws, Limits(wall_s=10.0, output_bytes=1 << 16))
    assert report.score == 0.0, report.summary()
    (ws / "mathx.py").write_text("def add(a, b):\n    return a + b\n")
    assert check_workspace(_ADD_TASK, ws).score == 1.0


def test_workspace_objects_reach_the_tests_through_calls(tmp_path):
    task = Task("objs", "s", tests=(
        TaskTest("class", "from pkg.shapes import Box\nb = Box(2, 3)\nassert b.area() == 6 and b.w == 2"),
        TaskTest("values", "import pkg.shapes as s\nassert s.NAMES == ('box',) and s.TABLE == {'a': [1, b'x']}"),
        TaskTest("raises", "import pkg.shapes as s\ntry:\n    s.boom()\nexcept ZeroDivisionError:\n    pass\n"
                           "else:\n    raise AssertionError('no raise')"),
        TaskTest("len_iter", "from pkg.shapes import Box\nassert len(Box(1, 1)) == 2 and list(Box(4, 5)) == [4, 5]"),
        TaskTest("files", "assert open('pkg/shapes.py').read().startswith('NAMES')"),
    ))
    ws = task.materialize(tmp_path / "ws")
    (ws / "pkg").mkdir()
    (ws / "pkg" / "__init__.py").write_text("")
    (ws / "pkg" / "shapes.py").write_text(
        "NAMES = ('box',)\nTABLE = {'a': [1, b'x']}\n"
        "class Box:\n    def __init__(self, w, h):\n        self.w, self.h = w, h\n"
        "    def area(self):\n        return self.w * self.h\n    def __len__(self):\n        return 2\n"
        "    def __iter__(self):\n        return iter([self.w, self.h])\n"
        "def boom():\n    return 1 / 0\n")
    report = check_workspace(task, ws)
    assert report.passed == (True,) * 5, report.summary()


def test_a_hanging_workspace_module_fails_its_test_and_later_tests_still_run(tmp_path):
    task = Task("t", "s", tests=(TaskTest("hangs", "import slow\nslow.f()"), TaskTest("after", "pass"),
                                 TaskTest("dies", "import dies"), TaskTest("last", "assert 1 + 1 == 2")))
    ws = task.materialize(tmp_path / "ws")
    (ws / "slow.py").write_text("def f():\n    while True:\n        pass\n")
    (ws / "dies.py").write_text("import os\nos.kill(os.getpid(), 9)\n")
    report = check_workspace(task, ws, Limits(wall_s=6.0, cpu_s=6))
    assert report.passed == (False, True, False, True), report.summary()
    assert "TimeoutError" in report.reasons[0] and "died" in report.reasons[2]


def test_score_workspace_scores_a_workspace_and_fails_every_test_when_the_checker_crashes(tmp_path):
    limits = Limits(wall_s=10.0, output_bytes=1 << 16)
    ws = _ADD_TASK.materialize(tmp_path / "ws")
    (ws / "mathx.py").write_text("def add(a, b):\n    return a + b\n")
    report, crash = score_workspace(_ADD_TASK, ws, limits)
    assert crash is None and report.score == 1.0
    gone = tmp_path / "not-a-dir"
    gone.write_text("the workspace was replaced by a file")
    report, crash = score_workspace(_ADD_TASK, gone, limits)
    assert crash is not None and crash.startswith("checker crashed: ")
    assert report.score == 0.0 and report.names == tuple(t.name for t in _ADD_TASK.tests)
    assert all(r == crash[:200] for r in report.reasons)

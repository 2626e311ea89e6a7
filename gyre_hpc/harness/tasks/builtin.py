"""The built-in task suites.

``easy``: answer-file tasks a tiny byte-level model learns within a few RL steps. Why it
can: the run is ONE model call (max_turns=1) and, since any output that is not a tool call
is appended to ``answer.txt``, the reward is a function of that single output's bytes.
Each check is a simple, local property of those bytes (non-empty, starts with a lowercase
letter, holds a digit, short), so even a random policy earns some checks (a graded, dense
signal rather than all-or-nothing), and every check is one that random sampling hits often
enough to be reinforced: a lowercase first byte (26 of 264 ids, ~10%), a digit somewhere
(~10/264 per byte), an early EOS. A check a random policy never hits (say "starts with
'ok'", 1 in ~70,000) gives no gradient and cannot be learnt in a few steps. Group-
normalised advantages then push the policy up each check's gradient step by step.

``repo``: small repository-building tasks (write a module, fix a bug, make a package),
a few tests each, for models that have learnt the tool-call syntax.

``long``: the long-horizon coding suite (``longhorizon.py``), tens of model calls per run.

``xlong``: repositories of many modules (``xlong.py``), hundreds of model calls per run;
``xlong-large`` larger repositories of the same kind (430 to 654 calls in ``bench xlong``);
``xlong-mini`` the same at a few dozen.
"""
from __future__ import annotations

from gyre_hpc.harness.tasks.longhorizon import LONG
from gyre_hpc.harness.tasks.xlong import XLONG, XLONG_LARGE, XLONG_MINI
from gyre_hpc.harness.tasks.spec import Task, TaskTest


def _answer() -> str:
    return "data = open('answer.txt', 'rb').read()\n"


EASY = (
    Task(
        task_id="answer-short",
        spec="Answer in at most 16 bytes, starting with a lowercase letter and holding a digit.",
        tests=(
            TaskTest("not_empty", _answer() + "assert data.strip()"),
            TaskTest("starts_lower", _answer() + "assert data[:1].islower()"),
            TaskTest("has_digit", _answer() + "assert any(48 <= b <= 57 for b in data)"),
            TaskTest("short", _answer() + "assert 0 < len(data) <= 16"),
        ),
        max_turns=1,
    ),
    Task(
        task_id="answer-lower",
        spec="Answer with lowercase letters only, at most 12 bytes, containing the letter 'a'.",
        tests=(
            TaskTest("not_empty", _answer() + "assert data.strip()"),
            TaskTest("lowercase", _answer() + "assert data.strip() and all(97 <= b <= 122 for b in data.strip())"),
            TaskTest("short", _answer() + "assert 0 < len(data) <= 12"),
            TaskTest("has_a", _answer() + "assert b'a' in data"),
        ),
        max_turns=1,
    ),
)

REPO = (
    Task(
        task_id="add-function",
        spec="Create mathx.py with a function add(a, b) that returns a + b.",
        tests=(
            TaskTest("module_exists", "import os\nassert os.path.isfile('mathx.py')"),
            TaskTest("imports", "import mathx"),
            TaskTest("add_ints", "import mathx\nassert mathx.add(2, 3) == 5"),
            TaskTest("add_strs", "import mathx\nassert mathx.add('a', 'b') == 'ab'"),
        ),
    ),
    Task(
        task_id="fix-bug",
        spec="stats.py has a bug: mean() must return the arithmetic mean of a list. Fix it.",
        files={"stats.py": "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n"},
        tests=(
            TaskTest("imports", "import stats"),
            TaskTest("mean_simple", "import stats\nassert stats.mean([1, 2, 3]) == 2"),
            TaskTest("mean_one", "import stats\nassert stats.mean([5]) == 5"),
        ),
    ),
    Task(
        task_id="greet-package",
        spec="Make a package greet/ with __init__.py defining VERSION = '1.0' and hello(name) "
             "returning 'hello ' + name.",
        tests=(
            TaskTest("package_exists", "import os\nassert os.path.isfile('greet/__init__.py')"),
            TaskTest("version", "import greet\nassert greet.VERSION == '1.0'"),
            TaskTest("hello", "import greet\nassert greet.hello('bob') == 'hello bob'"),
        ),
    ),
    Task(
        task_id="fizzbuzz",
        spec="Create fb.py with fizzbuzz(n) returning 'Fizz' for multiples of 3, 'Buzz' for 5, "
             "'FizzBuzz' for both, else str(n).",
        tests=(
            TaskTest("imports", "import fb"),
            TaskTest("plain", "import fb\nassert fb.fizzbuzz(1) == '1'"),
            TaskTest("fizz", "import fb\nassert fb.fizzbuzz(9) == 'Fizz'"),
            TaskTest("buzz", "import fb\nassert fb.fizzbuzz(10) == 'Buzz'"),
            TaskTest("fizzbuzz", "import fb\nassert fb.fizzbuzz(30) == 'FizzBuzz'"),
        ),
    ),
)

SUITES: dict[str, tuple[Task, ...]] = {"easy": EASY, "repo": REPO, "builtin": EASY + REPO, "long": LONG,
                                        "xlong": XLONG, "xlong-large": XLONG_LARGE,
                                        "xlong-mini": XLONG_MINI}

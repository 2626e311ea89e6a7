"""The ``long`` suite: coding tasks in a workspace that take tens of model calls.

Each task is a small repository (a README and a few modules with a bug or a stub) graded by
its tests, so the score is the fraction passed and partial work earns reward. A run reads
files, writes fixes, runs the tests (the ``integration`` test spends real seconds, as a real
test suite does), hands one module to a sub-agent, and finishes. Difficulty grows from
``lh-stats`` (two modules) to ``lh-inventory`` (a package of four, two delegations), and so
does the turn budget, so run lengths have a long tail; ``rollout.tool_latency_s`` adds a
seeded slow environment on top.

Why the files are short (one ``write`` call fits in 176 tokens, the ``long`` preset's ``rollout.max_new_tokens``):
a tiny byte-level model writes whole files, and a file that does not fit one call cannot be
written at all.

Each task carries a ``Playbook``: the solution and the detours a scripted teacher
(``gyre_hpc.harness.teacher``) takes to solve it the long way. The playbook is teacher-side
knowledge only; the model sees the task spec, the files and the tool results.

The tests grade in steps -- the delegated file exists, it imports, it behaves -- so a policy
that only gets the plan right (write the right file, even wrongly) already earns part of
the reward, which is the gradient RL climbs from a warm start.
"""
from __future__ import annotations

from dataclasses import dataclass

from gyre_hpc.harness.tasks.spec import Task, TaskTest


@dataclass(frozen=True)
class Subtask:
    """What the main agent delegates: the request text and the file the sub-agent writes."""

    request: str
    path: str
    solution: str
    wrong: str | None = None      # a first attempt the sub-agent gets wrong, then fixes


@dataclass(frozen=True)
class Playbook:
    """How the teacher solves a task: main-agent fixes (path -> (wrong, right)), then subtasks."""

    fixes: tuple[tuple[str, str | None, str], ...]    # (path, wrong first attempt or None, solution)
    subtasks: tuple[Subtask, ...]


def _suite_test(seconds: float, code: str) -> TaskTest:
    """The slow end-to-end test: a real test suite takes real seconds."""
    return TaskTest("integration", f"import time\ntime.sleep({seconds!r})\n{code}")


_STATS = Task(
    task_id="lh-stats",
    spec="Fix stats.py (see README.md); delegate med.py to a sub-agent; make the tests pass.",
    files={
        "README.md": "stats: mean(xs) is the arithmetic mean; med.py holds median(xs) of an odd-length list.\n",
        "stats.py": "def mean(xs):\n    return sum(xs) / (len(xs) + 1)\n",
    },
    tests=(
        TaskTest("imports", "import stats"),
        TaskTest("mean_simple", "import stats\nassert stats.mean([1, 2, 3]) == 2"),
        TaskTest("mean_one", "import stats\nassert stats.mean([5]) == 5"),
        TaskTest("median_file", "import os\nassert os.path.isfile('med.py')"),
        TaskTest("median_imports", "import med"),
        TaskTest("median_odd", "import med\nassert med.median([3, 1, 2]) == 2"),
        _suite_test(0.4, "import stats, med\nassert stats.mean([2, 4]) == 3 and med.median([9]) == 9"),
    ),
    max_turns=14,
)

_GREET = Task(
    task_id="lh-greet",
    spec="Finish the greet package (see README.md); delegate greet/shout.py; make the tests pass.",
    files={
        "README.md": "greet: VERSION = '1.0'; hello(name) returns 'hello ' + name; "
                     "shout.py: shout(s) returns s.upper() + '!'.\n",
        "greet/__init__.py": "VERSION = '0.9'\n",
    },
    tests=(
        TaskTest("package", "import os\nassert os.path.isfile('greet/__init__.py')"),
        TaskTest("version", "import greet\nassert greet.VERSION == '1.0'"),
        TaskTest("hello", "import greet\nassert greet.hello('bob') == 'hello bob'"),
        TaskTest("shout_file", "import os\nassert os.path.isfile('greet/shout.py')"),
        TaskTest("shout_imports", "import greet.shout"),
        TaskTest("shout", "from greet.shout import shout\nassert shout('hi') == 'HI!'"),
        _suite_test(0.6, "import greet\nfrom greet.shout import shout\nassert shout(greet.hello('a')) == 'HELLO A!'"),
    ),
    max_turns=16,
)

_FIZZ = Task(
    task_id="lh-fizz",
    spec="Implement fb.py and fbrange.py (see README.md); delegate fbrange.py; make the tests pass.",
    files={
        "README.md": "fb.fizzbuzz(n): 'Fizz' for multiples of 3, 'Buzz' of 5, 'FizzBuzz' of both, else str(n). "
                     "fbrange.upto(n): [fizzbuzz(1), ..., fizzbuzz(n)].\n",
        "fb.py": "def fizzbuzz(n):\n    return str(n)\n",
    },
    tests=(
        TaskTest("imports", "import fb"),
        TaskTest("plain", "import fb\nassert fb.fizzbuzz(1) == '1'"),
        TaskTest("fizz", "import fb\nassert fb.fizzbuzz(9) == 'Fizz'"),
        TaskTest("buzz", "import fb\nassert fb.fizzbuzz(10) == 'Buzz'"),
        TaskTest("fizzbuzz", "import fb\nassert fb.fizzbuzz(30) == 'FizzBuzz'"),
        TaskTest("range_file", "import os\nassert os.path.isfile('fbrange.py')"),
        TaskTest("range_imports", "import fbrange"),
        TaskTest("range", "import fbrange\nassert fbrange.upto(3) == ['1', '2', 'Fizz']"),
        _suite_test(0.8, "import fbrange\nassert fbrange.upto(15)[-1] == 'FizzBuzz'"),
    ),
    max_turns=18,
)

_INVENTORY = Task(
    task_id="lh-inventory",
    spec="Build the inv package (see README.md): fix inv/store.py, delegate inv/report.py and inv/cli.py.",
    files={
        "README.md": "inv: store.Store (a dict) with add(name, n) and count(name) (0 if unknown); "
                     "report.total(store) sums all counts; cli.run(args) adds 'name=n' pairs, returns total.\n",
        "inv/__init__.py": "",
        "inv/store.py": "class Store(dict):\n    def add(self, k, n):\n        self[k] = n\n",
    },
    tests=(
        TaskTest("imports", "import inv.store"),
        TaskTest("add_count", "from inv.store import Store\ns = Store()\ns.add('a', 2)\nassert s.count('a') == 2"),
        TaskTest("count_unknown", "from inv.store import Store\nassert Store().count('z') == 0"),
        TaskTest("add_twice", "from inv.store import Store\ns = Store()\ns.add('a', 2)\ns.add('a', 3)\n"
                              "assert s.count('a') == 5"),
        TaskTest("report_file", "import os\nassert os.path.isfile('inv/report.py')"),
        TaskTest("report_imports", "import inv.report"),
        TaskTest("report_total", "from inv.store import Store\nfrom inv.report import total\ns = Store()\n"
                                 "s.add('a', 2)\ns.add('b', 1)\nassert total(s) == 3"),
        TaskTest("cli_file", "import os\nassert os.path.isfile('inv/cli.py')"),
        TaskTest("cli_imports", "import inv.cli"),
        TaskTest("cli_run", "from inv.cli import run\nassert run(['a=2', 'b=3']) == 5"),
        _suite_test(1.2, "from inv.cli import run\nassert run(['x=1', 'x=1']) == 2"),
    ),
    max_turns=24,
)

LONG = (_STATS, _GREET, _FIZZ, _INVENTORY)

PLAYBOOKS: dict[str, Playbook] = {
    "lh-stats": Playbook(
        fixes=(("stats.py", "def mean(xs):\n    return sum(xs) / len(xs) + 1\n",
                "def mean(xs):\n    return sum(xs) / len(xs)\n"),),
        subtasks=(Subtask("write med.py with median(xs) of an odd-length list", "med.py",
                          "def median(xs):\n    return sorted(xs)[len(xs) // 2]\n"),)),
    "lh-greet": Playbook(
        fixes=(("greet/__init__.py", "VERSION = '1.0'\n",
                "VERSION = '1.0'\n\ndef hello(name):\n    return 'hello ' + name\n"),),
        subtasks=(Subtask("write greet/shout.py with shout(s) = s.upper() + '!'", "greet/shout.py",
                          "def shout(s):\n    return s.upper() + '!'\n", "def shout(s):\n    return s.upper()\n"),)),
    "lh-fizz": Playbook(
        fixes=(("fb.py", "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) or str(n)\n",
                "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)\n"),),
        subtasks=(Subtask("write fbrange.py with upto(n) = [fb.fizzbuzz(k) for k in 1..n]", "fbrange.py",
                          "import fb\n\ndef upto(n):\n    return [fb.fizzbuzz(k) for k in range(1, n + 1)]\n",
                          "import fb\n\ndef upto(n):\n    return [fb.fizzbuzz(k) for k in range(n)]\n"),)),
    "lh-inventory": Playbook(
        fixes=(("inv/store.py",
                "class Store(dict):\n    def add(self, k, n):\n        self[k] = n\n    def count(self, k):\n"
                "        return self[k]\n",
                "class Store(dict):\n    def add(self, k, n):\n        self[k] = self.count(k) + n\n"
                "    def count(self, k):\n        return self.get(k, 0)\n"),),
        subtasks=(
            Subtask("write inv/report.py with total(store) = sum of the store's values", "inv/report.py",
                    "def total(store):\n    return sum(store.values())\n"),
            Subtask("write inv/cli.py with run(args): add each 'name=n' to a Store, return the total", "inv/cli.py",
                    "from inv.store import Store\n\ndef run(args):\n    s = Store()\n    for a in args:\n"
                    "        k, v = a.split('=')\n        s.add(k, int(v))\n    return sum(s.values())\n",
                    "from inv.store import Store\n\ndef run(args):\n    s = Store()\n    for a in args:\n"
                    "        s.add(*a.split('='))\n    return len(s)\n"),
        )),
}

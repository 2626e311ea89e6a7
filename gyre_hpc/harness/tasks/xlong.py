"""The ``xlong`` suite: repositories of many small modules that take hundreds of model calls.

A task is a repository of ``P`` packages ``p0 .. p{P-1}`` of ``MODULES`` modules each
(``p1/m04.py``). Every module defines ``f(x)`` and every one starts wrong. A competent agent
loops: run the tests, read the first failing module, write its fix, run the tests again; it
fixes ``p0`` itself and hands each other package to a sub-agent, which loops the same way over
its package with the tests scoped to it (``test`` with ``scope: "p1"``) and finishes once they
all pass. About three calls per module, a delegation and a test per package, a compression
every few dozen calls (the context limit of ``examples/xlong.yaml``): 5 packages take about
290 calls and 500K tokens of context, 8 about 470 calls and 800K.

Why each fix is learnable by a tiny byte-level model: the test report (the count and the
first failure only, ``Task.report_failures``) names the next failing module and its fix as the
very arguments of the call that makes it (``FAIL p1/m04: AssertionError: fix {"path":
"p1/m04.py", "content": "def f(x):\\n    return x*3+1\\n", "task": "p1"}``), so each argument
the model writes next (``"path": "``, ``"content": "``, a delegation's ``"task": "``) continues
the last place it read the same words: a copy of text just seen (what an induction head does),
never a memory of the plan; and whether to delegate is whether the report names a task. The
report is all the state the loop needs: after a compression the agent runs the tests and carries on.

Why the checks are cheap: a module's test parses its file with ``ast`` in the judge (no worker
process), comparing ``f``'s return expression with the wanted one; each package's test imports
its modules in one worker and calls them. So a check of a 10-package task costs ten workers,
not 130, and the tests grade partial work module by module.

``XLONG_PLAYBOOKS`` holds what the teacher (``harness.teacher.RepoTeacher``) knows: every
module's path, wanted expression and a wrong first attempt.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

from gyre_hpc.harness.tasks.spec import Task, TaskTest

MODULES = 16            # modules per package
# Packages per task: the run lengths of the suite (~290 to ~470 calls for a competent agent).
SIZES = {"xl-p5": 5, "xl-p6": 6, "xl-p7": 7, "xl-p8": 8}
# ``xlong-large``: the same repositories from 8 to 11 packages (430 to 654 calls and 0.8 to 1.1
# million tokens of context a run in ``bench xlong``), for RL after a warm start on ``xlong`` (examples/xlong.yaml):
# every argument a call needs is in the last report, so a policy that learnt to copy it carries
# to repositories larger than any it was warm-started on.
LARGE_SIZES = {"xl-p8": 8, "xl-p9": 9, "xl-p10": 10, "xl-p11": 11}
# ``xlong-mini``: the same shape at a few dozen calls (packages, modules each), for quick checks
# (``gyre-hpc bench xlong --small``, tests).
MINI_SIZES = {"xm-p2": (2, 3), "xm-p3": (3, 3)}


@dataclass(frozen=True)
class ModuleFix:
    """One module: its path, the expression ``f`` must return, the one it starts with, and the
    wrong fix a teacher writes first now and then."""

    path: str
    want: str
    start: str
    wrong: str

    @property
    def test_name(self) -> str:
        return self.path.removesuffix(".py")

    @property
    def package(self) -> str:
        return self.path.split("/")[0]


@dataclass(frozen=True)
class RepoPlaybook:
    """What the teacher knows of an ``xlong`` task: the modules in test order. ``own``: the
    package the main agent fixes itself; the others it delegates."""

    modules: tuple[ModuleFix, ...]
    own: str = "p0"

    def module(self, path: str) -> ModuleFix | None:
        return next((m for m in self.modules if m.path == path), None)


def module_source(expr: str) -> str:
    """A module's whole text: what a fix writes in one call."""
    return f"def f(x):\n    return {expr}\n"


_RETURNS = ("def returns(path):\n"
            "    try:\n"
            "        tree = ast.parse(open(path).read())\n"
            "    except Exception:\n"
            "        return []\n"
            "    return [ast.dump(n.body[0].value) for n in tree.body if isinstance(n, ast.FunctionDef) "
            "and n.name == 'f' and n.body and isinstance(n.body[0], ast.Return) and n.body[0].value]\n")


def _wants(mods: list[ModuleFix]) -> str:
    return "{" + ", ".join(f"{m.path!r}: ast.dump(ast.parse({m.want!r}, mode='eval').body)" for m in mods) + "}"


def fix_message(m: ModuleFix, own: str) -> str:
    """What a module's failing test says: the fix as the arguments of the call that makes it
    (and, for a package the main agent delegates, the sub-agent's task), so the next call
    continues text the model has just read."""
    args = {"path": m.path, "content": module_source(m.want)}
    if m.package != own:
        args["task"] = m.package
    return "fix " + json.dumps(args)


def _module_test(m: ModuleFix, own: str) -> TaskTest:
    # Parsed, never run, in the judge (no worker process): the expression is compared as a
    # syntax tree, so spacing and parentheses the parser drops do not matter, and a file that
    # does not parse fails with the same message.
    code = (f"import ast\n{_RETURNS}want = {_wants([m])}\n"
            f"assert returns({m.path!r}) == [want[{m.path!r}]], {fix_message(m, own)!r}")
    return TaskTest(m.test_name, code)


def _package_test(package: str, mods: list[ModuleFix]) -> TaskTest:
    """The package's modules imported in one worker and called: the behaviour, not the text.
    The worker starts only once every module parses right (a check while the package is half
    done costs no process)."""
    names = [m.test_name.split("/")[1] for m in mods]
    expected = [eval(m.want, {"x": 7}) for m in mods]   # noqa: S307 - our own constant expressions
    code = (f"import ast\n{_RETURNS}want = {_wants(mods)}\n"
            f"assert all(returns(p) == [w] for p, w in want.items()), 'fix the modules of {package} first'\n"
            f"from {package} import {', '.join(names)}\n"
            f"assert [{', '.join(f'{n}.f(7)' for n in names)}] == {expected!r}, "
            f"'want every f of {package} as its module test says'")
    return TaskTest(package, code)


def _expr(a: int, b: int) -> str:
    return f"x*{a}+{b}"


def repo_task(task_id: str, packages: int, modules: int = MODULES, seed: int = 0,
              broken: float = 1.0) -> tuple[Task, RepoPlaybook]:
    """A repository of ``packages`` x ``modules`` modules, each starting wrong with probability
    ``broken`` (the suite's: all of them); its playbook."""
    rng = random.Random(f"{seed}/{task_id}")
    mods: list[ModuleFix] = []
    for p in range(packages):
        for k in range(modules):
            a, b = rng.randint(2, 9), rng.randint(1, 9)
            start = _expr(a, b + 1) if rng.random() < broken else _expr(a, b)
            mods.append(ModuleFix(f"p{p}/m{k:02d}.py", _expr(a, b), start, _expr(a + 1, b)))
    files = {"README.md": f"Packages p0..p{packages - 1}, modules m00..m{modules - 1:02d}: each defines f(x); "
                          "the tests say what f must return.\n"}
    tests: list[TaskTest] = []
    for m in mods:
        files[m.path] = module_source(m.start)
        tests.append(_module_test(m, "p0"))
    # The package tests last: the judge shares the wall clock among the tests still to run, so
    # the ones that start a worker get most of it, and a report's first failure is a module.
    for p in range(packages):
        files[f"p{p}/__init__.py"] = ""
        tests.append(_package_test(f"p{p}", [m for m in mods if m.package == f"p{p}"]))
    # One spec for every task: what to do next is always in the last test report.
    spec = ("Make the tests pass: fix p0 yourself, give each other package to a sub-agent. "
            "Test, read the first failing module, write its fix, test again.")
    # Main calls a competent run needs: p0's modules (3 each), a delegation and a test per
    # other package, the first test and the finish; twice that leaves room for detours.
    main_turns = 2 * (3 * modules + 2 * (packages - 1) + 2)
    task = Task(task_id=task_id, spec=spec, files=files, tests=tuple(tests), max_turns=main_turns, report_failures=1)
    return task, RepoPlaybook(tuple(mods))


# The teacher's variants of a task for the warm start: the same shape, other wants, and on odd
# variants a fifth of the modules already right. A warm start on the suite's own tasks can
# predict each next call by its place in a memorised sequence (module after module, each want
# by heart); on variants only what the last report says predicts it, so that is what the policy
# learns to read. Even variants start all broken, as the suite's tasks do: with every variant
# part-fixed the first report ("0/85 pass, m00 first") was a state the warm start never saw,
# and the policy misread its very first path.
VARIANT_BROKEN = 0.8


def repo_variant(task_id: str, k: int) -> tuple[Task, RepoPlaybook]:
    """Variant ``k`` (0, 1, ...) of suite task ``task_id``, with its playbook: all modules
    broken for even ``k``, a share ``VARIANT_BROKEN`` for odd ``k``."""
    sizes = {**{t: (n, MODULES) for t, n in {**SIZES, **LARGE_SIZES}.items()}, **MINI_SIZES}
    if task_id not in sizes:
        raise ValueError(f"task {task_id!r} is not an xlong task; they are {', '.join(sizes)}")
    packages, modules = sizes[task_id]
    return repo_task(task_id, packages, modules, seed=k + 1, broken=1.0 if k % 2 == 0 else VARIANT_BROKEN)


_BUILT = {tid: repo_task(tid, n) for tid, n in {**SIZES, **LARGE_SIZES}.items()}
_MINI = {tid: repo_task(tid, p, m) for tid, (p, m) in MINI_SIZES.items()}
XLONG = tuple(_BUILT[tid][0] for tid in SIZES)
XLONG_LARGE = tuple(_BUILT[tid][0] for tid in LARGE_SIZES)
XLONG_MINI = tuple(task for task, _ in _MINI.values())
XLONG_PLAYBOOKS: dict[str, RepoPlaybook] = {tid: pb for tid, (_, pb) in {**_BUILT, **_MINI}.items()}

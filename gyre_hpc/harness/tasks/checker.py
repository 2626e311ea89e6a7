"""Score a workspace: the fraction of a task's tests that pass, the tests run confined.

All tests of a task run in ONE confined ``python3`` process (one sandbox start, not one
per test). The runner prints one result line per test as it goes, tagged with a random
nonce, so a test that hangs or a process killed at the wall clock still leaves the earlier
results readable: a test without a result line counts as failed. Test code runs with the
workspace first on ``sys.path`` and the workspace's modules forgotten between tests.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness.confine import Limits, run_confined
from gyre_hpc.harness.tasks.spec import Task

_RUNNER = r'''
import json, os, sys, traceback
NONCE = %(nonce)r
TESTS = json.loads(%(tests)r)
here = os.getcwd()
# Results go to a private copy of stdout; whatever the code under test prints goes nowhere.
results = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
sys.stdout = sys.stderr = open(os.devnull, "w")
sys.path.insert(0, here)
base_modules = set(sys.modules)
for name, code in TESTS:
    for m in [m for m in sys.modules if m not in base_modules]:
        del sys.modules[m]
    try:
        exec(compile(code, "<test " + name + ">", "exec"), {"__name__": "__gyre_test__"})
        ok, why = True, ""
    except BaseException as exc:
        ok, why = False, (type(exc).__name__ + ": " + str(exc))[:200]
    results.write(NONCE + json.dumps([name, ok, why]) + "\n")
    results.flush()
'''


@dataclass(frozen=True)
class CheckReport:
    names: tuple[str, ...]
    passed: tuple[bool, ...]
    reasons: tuple[str, ...]

    @property
    def score(self) -> float:
        return sum(self.passed) / len(self.passed)

    def summary(self, max_chars: int = 400) -> str:
        """What the ``test`` tool shows the model."""
        lines = [f"{sum(self.passed)}/{len(self.passed)} tests passed"]
        lines += [f"FAIL {n}: {r}" for n, ok, r in zip(self.names, self.passed, self.reasons) if not ok]
        return "\n".join(lines)[:max_chars]


def check_workspace(task: Task, workspace: str | Path, limits: Limits = Limits(wall_s=20.0, output_bytes=1 << 16)) -> CheckReport:
    nonce = "@@" + secrets.token_hex(8) + "@@"
    tests = json.dumps([[t.name, t.code] for t in task.tests])
    script = _RUNNER % {"nonce": nonce, "tests": tests}
    result = run_confined("exec python3 -I -", Path(workspace), limits, stdin=script.encode())
    outcome: dict[str, tuple[bool, str]] = {}
    for line in result.output.decode("utf-8", errors="replace").splitlines():
        if line.startswith(nonce):
            try:
                name, ok, why = json.loads(line[len(nonce):])
            except (ValueError, TypeError):
                continue
            outcome.setdefault(name, (bool(ok), str(why)))
    default = "killed at the wall clock" if result.timed_out else "no result (the test process died)"
    names = tuple(t.name for t in task.tests)
    got = [outcome.get(n, (False, default)) for n in names]
    return CheckReport(names, tuple(ok for ok, _ in got), tuple(why for _, why in got))

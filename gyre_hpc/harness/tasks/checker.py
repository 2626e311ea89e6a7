"""Score a workspace: the fraction of a task's tests that pass, the tests run confined.

Why two processes per check (a *judge* and, per test, a *worker*): code under test that runs
in the process that decides the verdict can forge it (read the runner's nonce and print
"passed" lines, ``os._exit(0)`` before the assertion, return an object equal to anything),
and no secret kept in that process survives code running beside it. So the workspace's
modules never run in the judge:

- the judge (one confined ``python3``, the jail's PID 1, made non-dumpable so a same-uid
  worker cannot open its memory or file descriptors) executes the test code. An ``import``
  of a module that lives in the workspace gets a proxy; its attributes, calls and results
  cross a pipe to a worker;
- each test gets a fresh worker (``python3 -I``, the workspace first on its path, its own
  output sent to /dev/null) that imports the real module and answers requests. What crosses
  back is data only: plain values (numbers, strings, bytes, lists, tuples, dicts, sets) are
  rebuilt by the judge with exact types; anything else is an opaque handle that compares
  equal to nothing but itself. A worker that dies, hangs past its share of the wall clock or
  speaks out of turn fails that test, never passes it;
- the judge writes one result line per test to the jail's stdout, which no worker holds,
  tagged with a nonce only the judge and the harness know; a test without a line failed.

Test code itself is the task author's (trusted); module names already imported by the judge
(the standard library it uses) are not proxied, so a workspace ``json.py`` does not shadow
``json`` for the tests.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness.confine import Limits, run_confined
from gyre_hpc.harness.tasks.spec import Task

# Shared by judge and worker: the data-only encoding of values crossing the pipe.
_CODEC = r'''
import base64, json

def _enc(obj, handle):
    t = type(obj)
    if obj is None or t in (bool, int, str):
        return obj
    if t is float:
        return {"float": repr(obj)}
    if t is bytes:
        return {"bytes": base64.b64encode(obj).decode()}
    if t in (list, tuple, set, frozenset):
        return {t.__name__: [_enc(x, handle) for x in obj]}
    if t is dict:
        return {"dict": [[_enc(k, handle), _enc(v, handle)] for k, v in obj.items()]}
    return handle(obj)

def _dec(obj, handle):
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed value from the workspace")
    (kind, v), = obj.items()
    if kind == "float":
        return float(v)
    if kind == "bytes":
        return base64.b64decode(v)
    if kind in ("list", "tuple", "set", "frozenset"):
        items = [_dec(x, handle) for x in v]
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
    if kind == "dict":
        return {_dec(k, handle): _dec(x, handle) for k, x in v}
    if kind == "handle":
        return handle(v)
    raise ValueError("malformed value from the workspace")
'''

_WORKER = _CODEC + r'''
import importlib, os, sys
proto_in = os.fdopen(os.dup(0), "r")
proto_out = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
sys.stdin = sys.stdout = sys.stderr = open(os.devnull, "r+")
sys.path.insert(0, os.getcwd())
objects = {}

def keep(obj):
    objects[id(obj)] = obj
    return {"handle": [id(obj), callable(obj), repr(type(obj).__name__)]}

def value(h):
    return objects[h[0]]

for line in proto_in:
    req = json.loads(line)
    try:
        op = req["op"]
        if op == "import":
            out = keep(importlib.import_module(req["name"]))
        else:
            target = value(req["target"])
            if op == "getattr":
                out = _enc(getattr(target, req["name"]), keep)
            elif op == "call":
                args = [_dec(a, value) for a in req["args"]]
                kwargs = {k: _dec(a, value) for k, a in req["kwargs"]}
                out = _enc(target(*args, **kwargs), keep)
            else:
                raise ValueError("unknown request")
        reply = {"ok": out}
    except BaseException as exc:
        reply = {"raise": [type(exc).__name__, str(exc)[:200]]}
    proto_out.write(json.dumps(reply) + "\n")
    proto_out.flush()
'''

_JUDGE = _CODEC + r'''
import builtins, ctypes, importlib.abc, importlib.util, os, select, subprocess, sys, time
# PR_SET_DUMPABLE 0: no same-uid ptrace, /proc/<pid>/mem or fd. Without it, no verdicts at all.
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:
    raise SystemExit("cannot make the judge non-dumpable")
NONCE = %(nonce)r
TESTS = json.loads(%(tests)r)
BUDGET_S = %(budget_s)r
WORKER = %(worker)r
here = os.getcwd()
results = os.fdopen(os.dup(1), "w")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.dup2(null, 2)
sys.stdout = sys.stderr = open(os.devnull, "w")


class WorkspaceError(Exception):
    """Raised in a test for an exception the workspace code raised that has no builtin twin."""


class Worker:
    def __init__(self, deadline):
        self.deadline = deadline
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", WORKER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=here, close_fds=True)
        self.buf = b""

    def ask(self, **req):
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the workspace code took longer than this test's share of the wall clock")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise WorkspaceError("the workspace process died (exit %%s)" %% self.proc.wait())
                self.buf += chunk
                if len(self.buf) > (16 << 20):
                    raise WorkspaceError("reply too large")
        line, self.buf = self.buf.split(b"\n", 1)
        reply = json.loads(line)
        if type(reply) is not dict or len(reply) != 1:
            raise WorkspaceError("malformed reply")
        if "raise" in reply:
            name, msg = reply["raise"]
            cls = getattr(builtins, str(name), None)
            if isinstance(cls, type) and issubclass(cls, Exception) and cls is not AssertionError:
                raise cls(msg)
            raise WorkspaceError("%%s: %%s" %% (name, msg))
        return _dec(reply["ok"], self.remote)

    def remote(self, h):
        return Remote(self, h)

    def close(self):
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()


class Remote:
    """An object living in the worker; equal to nothing but itself."""
    __slots__ = ("_w", "_h")

    def __init__(self, w, h):
        object.__setattr__(self, "_w", w)
        object.__setattr__(self, "_h", h)

    def __getattr__(self, name):
        return self._w.ask(op="getattr", target=self._h, name=name)

    def __call__(self, *args, **kwargs):
        enc = lambda v: _enc(v, _handle_of)
        return self._w.ask(op="call", target=self._h, args=[enc(a) for a in args],
                           kwargs=[[k, enc(v)] for k, v in kwargs.items()])

    def _method(self, name, *args):
        return self.__getattr__(name)(*args)

    def __len__(self):
        return int(self._method("__len__"))

    def __iter__(self):
        return iter(self._w.ask(op="call", target=self._w.ask(op="import", name="builtins").list._h,
                                args=[_enc(self, _handle_of)], kwargs=[]))

    def __getitem__(self, key):
        return self._method("__getitem__", key)

    def __contains__(self, item):
        return bool(self._method("__contains__", item))

    def __repr__(self):
        return "<workspace %%s>" %% self._h[2]

    def __eq__(self, other):
        return self is other

    def __hash__(self):
        return id(self)


def _handle_of(obj):
    if isinstance(obj, Remote):
        return {"handle": obj._h}
    raise TypeError("only plain values and workspace objects can be passed to workspace code")


def _in_workspace(top):
    return os.path.isfile(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))


class WorkspaceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Per test: the worker starts at the test's first workspace import (most checks of files
    import nothing) and ends with the test."""
    worker = None
    deadline = 0.0

    def find_spec(self, name, path=None, target=None):
        if not self.deadline or not _in_workspace(name.split(".")[0]):
            return None
        if self.worker is None:
            self.worker = Worker(self.deadline)
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        return RemoteModule(self.worker, self.worker.ask(op="import", name=spec.name)._h, spec.name)

    def exec_module(self, module):
        pass


class RemoteModule(Remote):
    __slots__ = ("__name__", "__spec__", "__loader__", "__path__", "__package__", "__file__")

    def __init__(self, w, h, name):
        Remote.__init__(self, w, h)
        object.__setattr__(self, "__name__", name)
        object.__setattr__(self, "__path__", [])

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Remote.__getattr__(self, name)


finder = WorkspaceFinder()
sys.meta_path.insert(0, finder)
base_modules = set(sys.modules)
start = time.monotonic()
for i, (name, code) in enumerate(TESTS):
    for m in [m for m in sys.modules if m not in base_modules]:
        del sys.modules[m]
    share = (BUDGET_S - (time.monotonic() - start)) / (len(TESTS) - i)
    finder.deadline = time.monotonic() + max(share, 0.05)
    try:
        exec(compile(code, "<test " + name + ">", "exec"), {"__name__": "__gyre_test__"})
        ok, why = True, ""
    except BaseException as exc:
        ok, why = False, (type(exc).__name__ + ": " + str(exc))[:200]
    finally:
        if finder.worker is not None:
            finder.worker.close()
        finder.worker, finder.deadline = None, 0.0
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

    def summary(self, max_chars: int = 400, failures: int | None = None) -> str:
        """What the ``test`` tool shows the model: the count, then the first ``failures`` failing
        tests (all by default), as ``pytest -x`` stops at the first (``Task.report_failures``)."""
        lines = [f"{sum(self.passed)}/{len(self.passed)} tests passed"]
        lines += [f"FAIL {n}: {r}" for n, ok, r in zip(self.names, self.passed, self.reasons) if not ok][:failures]
        return "\n".join(lines)[:max_chars]


def judge_script(task: Task, nonce: str, budget_s: float) -> str:
    """The judge's source, fed to ``python3 -I -`` on stdin (the worker's source rides inside)."""
    tests = json.dumps([[t.name, t.code] for t in task.tests])
    return _JUDGE % {"nonce": nonce, "tests": tests, "budget_s": budget_s, "worker": _WORKER}


def check_workspace(task: Task, workspace: str | Path, limits: Limits = Limits(wall_s=20.0, output_bytes=1 << 16)) -> CheckReport:
    nonce = "@@" + secrets.token_hex(8) + "@@"
    # The judge spreads 90% of the wall clock over the tests; the rest is its own start-up.
    script = judge_script(task, nonce, 0.9 * limits.wall_s)
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


def score_workspace(task: Task, workspace: str | Path, limits: Limits) -> tuple[CheckReport, str | None]:
    """A finished run's score from its final workspace, and why the checker crashed (None if it
    did not): a crashing checker fails that run with every test failed, never the fleet, so every
    kind of run (the harness's own loop, an outside scaffold) scores the same way."""
    try:
        return check_workspace(task, workspace, limits), None
    except Exception as exc:  # noqa: BLE001 - see the docstring
        crash = f"checker crashed: {type(exc).__name__}: {exc}"
        n = len(task.tests)
        return CheckReport(tuple(t.name for t in task.tests), (False,) * n, (crash[:200],) * n), crash

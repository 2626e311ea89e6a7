"""A scripted teacher for the ``xlong`` suite: it reacts to what the last tool said.

Why reactive, when the ``long`` teacher (``teacher.py``) follows a fixed plan: a run of
hundreds of calls is compressed every couple of dozen, retried and split among sub-agents, so
where the work stands is only known from the prompt. The teacher therefore acts on the last
turn of the prompt, as the policy it teaches must: a test report sends it to the first failing
module (or, in the main agent, to a sub-agent for another package, or to finish once all
pass); a module it has just read gets its fix written; anything else (a written file, a
sub-agent's answer, a summary, the task itself) makes it run the tests. The policy the warm
start learns is then a function of what the model sees, and it carries a run of any length.

Like ``TeacherClient`` it is a ``ModelClient`` plugged into a real ``AgentRun``; it emits calls
only through ``actions.format_action`` and summaries as plain text, in the run's tokenizer.
Detours, seeded: with ``early_finish``, a premature finish once ``p0`` is fixed, which the
harness answers with a retry; with ``wrong_rate`` (0 by default: a fix the report does not
spell out is not something a policy can learn from it), a wrong first fix now and then, after
which the next report names the same module again. A summary says only to run the tests.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence

from gyre_hpc.harness.actions import format_action
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.loop import SUMMARY_REQUEST
from gyre_hpc.harness.tasks.spec import Task
from gyre_hpc.harness.tasks.xlong import XLONG_PLAYBOOKS, RepoPlaybook, module_source
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer

_REPORT = re.compile(r"^(\d+)/(\d+) tests passed")
_FAIL = re.compile(r"^FAIL (\S+?):", re.MULTILINE)
_USER, _END = "<|im_start|>user\n", "<|im_end|>"
SUMMARY = "Run the tests to see what is left."
_RESULT_START, _RESULT_END = "<tool_response>\n", "\n</tool_response>"


def last_user_turn(text: str) -> tuple[str, str]:
    """(kind, text) of the prompt's last user turn: ``result`` (a tool's output), ``retry`` (the
    harness's retry report), ``summary``, or ``start`` (the task or subtask)."""
    at = text.rfind(_USER)
    body = text[at + len(_USER):] if at >= 0 else ""
    body = body[:body.find(_END)] if _END in body else body
    if body.startswith(_RESULT_START):
        return "result", body[len(_RESULT_START):].removesuffix(_RESULT_END.rstrip("\n")).rstrip("\n")
    if body.startswith("retry "):
        return "retry", body.split(": ", 1)[1] if ": " in body else ""
    if body.startswith("summary: "):
        return "summary", body[len("summary: "):]
    return "start", body


def first_failure(report: str) -> tuple[bool, str | None]:
    """(whether ``report`` is a test report, the first failing test's name or None)."""
    if not _REPORT.match(report):
        return False, None
    fail = _FAIL.search(report)
    return True, fail.group(1) if fail else None


class RepoTeacher:
    """One run's teacher: ``AgentRun(task, ..., client=RepoTeacher(task, seed))``."""

    def __init__(self, task: Task, seed: int = 0, playbook: RepoPlaybook | None = None,
                 tokenizer: ChatTokenizer | None = None, wrong_rate: float = 0.0, early_finish: float = 0.5) -> None:
        if playbook is None and task.task_id not in XLONG_PLAYBOOKS:
            raise ValueError(f"task {task.task_id!r} has no repository playbook; tasks with one: "
                             f"{', '.join(XLONG_PLAYBOOKS)}")
        for name, p in (("wrong_rate", wrong_rate), ("early_finish", early_finish)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"RepoTeacher: {name}={p} must be a probability in [0, 1]")
        self.task = task
        self.playbook = playbook or XLONG_PLAYBOOKS[task.task_id]
        self.tokenizer = tokenizer or embedded_tokenizer()
        self.rng = random.Random(f"{seed}/{task.task_id}")
        self.wrong_rate = wrong_rate
        self.finish_early = self.rng.random() < early_finish
        self.reading: dict[str, str] = {}      # agent -> the module it has just asked to read
        self.written: dict[str, int] = {}      # module path -> writes so far
        self.package_of: dict[str, str] = {}   # sub-agent id -> the package it was given
        self.delegations = 0
        self.calls = 0

    async def complete(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], *,
                       agent: str = "main") -> Completion:
        self.calls += 1
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        if SUMMARY_REQUEST in text[-(len(SUMMARY_REQUEST) + 64):]:
            # The report says where the work stands; the summary only has to say to look.
            ids = self.tokenizer.encode(SUMMARY) + [self.tokenizer.eos_id]
        else:
            ids = format_action(*self._act(agent, *last_user_turn(text)), tokenizer=self.tokenizer)
        ids = list(ids)[:max_new_tokens]
        return Completion(tuple(ids), (0.0,) * len(ids), 0)

    def _test(self, agent: str) -> tuple[str, ...]:
        return ("test", self.package_of[agent]) if agent in self.package_of else ("test",)

    def _act(self, agent: str, kind: str, body: str) -> tuple[str, ...]:
        reading = self.reading.pop(agent, None)
        if kind == "result" and reading is not None:
            return self._write(agent, reading)
        if kind in ("result", "retry"):
            is_report, first = first_failure(body)
            if is_report:
                return self._on_report(agent, first)
        return self._test(agent)

    def _on_report(self, agent: str, first: str | None) -> tuple[str, ...]:
        if first is None:
            return ("finish", f"{self.package_of[agent]} fixed") if agent in self.package_of else \
                ("finish", "all tests pass")
        package = first.split("/")[0]
        if agent == "main" and package != self.playbook.own:
            if self.finish_early:
                self.finish_early = False
                return ("finish", f"{self.playbook.own} fixed")
            self.delegations += 1
            self.package_of[f"sub{self.delegations}"] = package
            return ("delegate", package)
        path = first + ".py" if "/" in first else next((m.path for m in self.playbook.modules if m.package == first),
                                                             f"{first}/m00.py")
        self.reading[agent] = path
        return ("read", path)

    def _write(self, agent: str, path: str) -> tuple[str, ...]:
        module = self.playbook.module(path)
        if module is None:
            return self._test(agent)
        tries = self.written.get(path, 0)
        self.written[path] = tries + 1
        wrong = tries == 0 and self.rng.random() < self.wrong_rate
        return ("write", path, module_source(module.wrong if wrong else module.want))

"""A scripted teacher: a ModelClient that solves a ``long``-suite task the long way.

Why a script and not a search: the warm start (``gyre_hpc.warmstart``) needs trajectories
shaped like the runs RL will see -- exploration, a wrong first attempt, a premature finish
that the harness answers with a retry, a delegated module, summaries when the context
fills -- with every token id exactly what the harness loop builds. So the teacher is
plugged into the real ``AgentRun`` as its model client; the loop, tools, checker and
compression run as they do in RL, and only the choice of action is scripted.

The teacher reads nothing of the harness's internals. It tells calls apart by the text of
the prompt (the tokenizer's ``decode``, specials dropped): a prompt that ends with the summary request is a summary
call, one that carries the sub-agent system text is the current sub-agent's turn, any
other is the main agent's. It produces tool calls only through ``actions.format_action``
with the run's tokenizer, so it emits whatever call syntax and ids those define (no token id
is assumed here: end-of-turn is the tokenizer's ``eos_id``). Its plan does not react to tool
results (it knows the playbook), which is enough: the model it teaches sees those results
in its context and learns the plan conditioned on them.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from gyre_hpc.harness.actions import format_action
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.loop import SUBAGENT_TEXT, SUMMARY_REQUEST
from gyre_hpc.harness.tasks.longhorizon import PLAYBOOKS, Playbook, Subtask
from gyre_hpc.harness.tasks.spec import Task
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer

Step = tuple[str, ...]     # (tool, *args) as format_action takes them


def plain_text_output(text: str, tokenizer: ChatTokenizer | None = None) -> list[int]:
    """A non-tool output (a summary): the text, then end of turn, as a model should emit it."""
    tok = tokenizer or embedded_tokenizer()
    return tok.encode(text) + [tok.eos_id]


def _note(step: Step) -> str:
    tool, *args = step
    if tool == "write":
        return f"wrote {args[0]}"
    if tool == "read":
        return f"read {args[0]}"
    if tool == "delegate":
        return "delegated " + args[0].split(" with ")[0].removeprefix("write ")
    return {"test": "ran tests", "list": "listed files", "exec": "ran a command"}.get(tool, tool)


def main_plan(task: Task, playbook: Playbook, rng: random.Random, give_up: float = 0.0,
              give_up_rng: random.Random | None = None) -> list[Step]:
    """Explore, get the main fix wrong once, finish too early (the harness retries), delegate, finish.

    With probability ``give_up`` the teacher gives up at the retry: it answers the harness's
    "retry" with a second finish instead of delegating, so the run ends without the
    sub-agent's module and scores only part of the tests. A warm start trained on such runs
    makes that one decision (delegate or stop, right after the retry) at about that rate, and
    the reward tells the two apart by the delegated module's tests: the signal RL improves
    on. The choice is drawn from ``give_up_rng`` (the caller seeds it per task, so one seed
    does not give up on every task alike); the detours' stream ``rng`` is the same as without it."""
    plan: list[Step] = [("list",), ("read", "README.md")]
    plan += [("read", path) for path in task.files if path != "README.md" and task.files[path]]
    for path, wrong, solution in playbook.fixes:
        if wrong is not None and rng.random() < 0.85:
            plan += [("write", path, wrong), ("test",), ("read", path)]
        plan += [("write", path, solution), ("test",)]
    if rng.random() < 0.5:
        plan.append(("exec", "ls -R"))
    plan.append(("finish", "fixed " + ", ".join(p for p, _, _ in playbook.fixes)))
    if give_up and (give_up_rng or rng).random() < give_up:
        return plan + [("finish", "all tests pass")]
    plan += [("delegate", sub.request) for sub in playbook.subtasks]
    plan += [("test",), ("finish", "all tests pass")]
    return plan


def sub_plan(sub: Subtask, rng: random.Random) -> list[Step]:
    plan: list[Step] = [("read", "README.md")]
    if sub.wrong is not None and rng.random() < 0.85:
        plan += [("write", sub.path, sub.wrong), ("test",)]
    plan += [("write", sub.path, sub.solution), ("test",), ("finish", f"wrote {sub.path}")]
    return plan


class TeacherClient:
    """One run's teacher (it keeps the run's plan position): ``AgentRun(..., client=TeacherClient(task))``.

    ``tokenizer`` must be the one the run's ``AgentRun`` builds prompts with (the embedded
    default unless a checkpoint brings its own). ``give_up``: see ``main_plan``."""

    def __init__(self, task: Task, seed: int = 0, playbook: Playbook | None = None,
                 tokenizer: ChatTokenizer | None = None, give_up: float = 0.0) -> None:
        if playbook is None and task.task_id not in PLAYBOOKS:
            raise ValueError(f"task {task.task_id!r} has no teacher playbook; tasks with one: {', '.join(PLAYBOOKS)}")
        self.task = task
        self.tokenizer = tokenizer or embedded_tokenizer()
        self.playbook = playbook or PLAYBOOKS[task.task_id]
        rng = random.Random(seed)
        if not 0.0 <= give_up <= 1.0:
            raise ValueError(f"TeacherClient: give_up={give_up} must be a probability in [0, 1]")
        self.main = deque(main_plan(task, self.playbook, rng, give_up,
                                    random.Random(f"{seed}/{task.task_id}/give-up")))
        self.subs = [sub_plan(s, rng) for s in self.playbook.subtasks]
        self.sub: deque[Step] = deque()
        self.delegated = 0
        self.notes: dict[str, list[str]] = {"main": [], "sub": []}
        self.calls = 0

    async def complete(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int], *,
                       agent: str = "main") -> Completion:
        self.calls += 1
        text = self.tokenizer.decode(prompt, skip_special_tokens=True)
        agent = "sub" if SUBAGENT_TEXT in text else "main"
        if SUMMARY_REQUEST in text[-(len(SUMMARY_REQUEST) + 32):]:
            done = self.notes[agent][-4:] or ["started"]
            ids = plain_text_output("done: " + "; ".join(done), self.tokenizer)
        else:
            step = self._next(agent)
            self.notes[agent].append(_note(step))
            ids = format_action(*step, tokenizer=self.tokenizer)
        ids = list(ids)[:max_new_tokens]
        return Completion(tuple(ids), (0.0,) * len(ids), 0)

    def _next(self, agent: str) -> Step:
        if agent == "sub":
            return self.sub.popleft() if self.sub else ("finish", "done")
        self.sub.clear()   # a sub-agent whose turn budget ran out leaves its plan unfinished
        step = self.main.popleft() if self.main else ("finish", "done")
        if step[0] == "delegate":
            if self.delegated < len(self.subs):
                self.sub = deque(self.subs[self.delegated])
            self.delegated += 1
            self.notes["sub"] = []
        return step

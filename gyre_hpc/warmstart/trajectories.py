"""Teacher trajectories through the real harness loop, so their token ids are the harness's own.

The teacher (``harness.teacher.TeacherClient``) stands in for the model client of an
ordinary ``AgentRun``: the same prompts, tools, checker, compression, retries and
delegation as an RL run with the same ``rollout`` settings. What comes back is the run's
journal of calls, built into a tree exactly as the RL controller builds one.
"""
from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gyre_hpc.harness.loop import AgentRun, HarnessConfig, RunResult
from gyre_hpc.harness.tasks import Task
from gyre_hpc.harness.repo_teacher import RepoTeacher
from gyre_hpc.harness.tasks.longhorizon import PLAYBOOKS
from gyre_hpc.harness.tasks.xlong import XLONG_PLAYBOOKS, repo_variant
from gyre_hpc.harness.teacher import TeacherClient
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import Tree


@dataclass(frozen=True)
class TeacherRuns:
    results: tuple[RunResult, ...]
    trees: tuple[Tree, ...]

    def stats(self) -> dict:
        n = len(self.results)
        calls = [len(r.calls) for r in self.results]
        return {"runs": n, "calls_mean": sum(calls) / n, "calls_max": max(calls),
                "reward_mean": sum(r.reward for r in self.results) / n,
                "with_retry": sum(r.retries > 0 for r in self.results),
                "with_compression": sum(r.compressions > 0 for r in self.results),
                "with_subagent": sum(r.delegations > 0 for r in self.results),
                "tokens": sum(t.n_tokens for t in self.trees),
                "trained_tokens": int(sum(t.trained.sum() for t in self.trees))}


def gives_up(g: int, rate: float) -> float:
    """Whether teacher run ``g`` of a task gives up at the retry (1.0) or not (0.0): a share
    ``rate`` of every task's runs, spread evenly (g = 1, 3, ... for 0.5; g = 3, 7, ... for
    0.25), so each task's warm-start data holds both choices after the same kind of context;
    a coin per run could give one task only delegations and another only give-ups."""
    return float(int((g + 1) * rate) > int(g * rate))


def playbook_of(task: Task):
    """The teacher's knowledge of ``task`` (a ``long`` or an ``xlong`` playbook), or None."""
    return PLAYBOOKS.get(task.task_id) or XLONG_PLAYBOOKS.get(task.task_id)


def teacher_run(task: Task, g: int, seed: int, tokenizer: ChatTokenizer, give_up: float,
                wrong_rate: float = 0.0):
    """Teacher run ``g`` of ``task``: (the task it runs, its scripted client). A ``long`` task
    runs itself with the plan follower (``give_up``: see ``teacher.main_plan``); an ``xlong``
    task runs its variant ``g`` (``tasks.xlong.repo_variant``: other wants, some modules
    already right) with the reactive teacher, so the warm start learns to read the reports.
    ``wrong_rate``: the reactive teacher's share of first writes that are wrong
    (``RepoTeacher``), so the data holds a failed fix and its recovery."""
    if task.task_id in XLONG_PLAYBOOKS:
        variant, playbook = repo_variant(task.task_id, g)
        return variant, RepoTeacher(variant, seed=seed, playbook=playbook, tokenizer=tokenizer, wrong_rate=wrong_rate)
    return task, TeacherClient(task, seed=seed, tokenizer=tokenizer, give_up=give_up)


def teacher_variants(tasks: list[Task], runs_per_task: int) -> list[str]:
    """What the teacher runs of ``xlong`` tasks work on (their variants, as text): part of the
    warm start's cache key. Empty for other suites, whose teacher runs the tasks themselves."""
    return [repr(repo_variant(t.task_id, g)) for t in tasks if t.task_id in XLONG_PLAYBOOKS
            for g in range(runs_per_task)]


async def _run_all(tasks: list[Task], runs_per_task: int, cfg: HarnessConfig, root: Path, seed: int,
                   tokenizer: ChatTokenizer, give_up: float, wrong_rate: float) -> list[RunResult]:
    runs = []
    for t in tasks:
        for g in range(runs_per_task):
            rid = f"teacher-{t.task_id}-{g}"
            task, client = teacher_run(t, g, seed * 7919 + g, tokenizer, gives_up(g, give_up), wrong_rate)
            runs.append(AgentRun(task, root / rid, client, root / f"{rid}.jsonl", cfg, run_id=rid, tokenizer=tokenizer))
    return list(await asyncio.gather(*(r.run(resume=False) for r in runs)))


def teacher_runs(tasks: list[Task], runs_per_task: int, cfg: HarnessConfig, seed: int = 0,
                 workdir: str | Path | None = None, tokenizer: ChatTokenizer | None = None,
                 give_up: float = 0.0, wrong_rate: float = 0.0) -> TeacherRuns:
    """``runs_per_task`` teacher runs of every task (seeds vary the detours), as trees; prompts
    and calls in ``tokenizer``'s ids (the embedded default unless given); ``give_up``: the
    teacher's rate of giving up at the retry (``harness.teacher.main_plan``); ``wrong_rate``:
    the ``xlong`` teacher's rate of wrong first writes (``teacher_run``)."""
    tokenizer = tokenizer or embedded_tokenizer()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        results = asyncio.run(_run_all(tasks, runs_per_task, cfg, Path(tmp), seed, tokenizer, give_up, wrong_rate))
    failed = [r.run_id for r in results if r.status == "failed"]
    if failed:
        raise RuntimeError(f"teacher runs {failed[:3]} failed: {[r.error for r in results if r.error][:3]}")
    trees = tuple(build_tree(r.calls, run_id=r.run_id, task_id=r.task_id, reward=r.reward, status=r.status,
                             wall_s=r.wall_s) for r in results)
    return TeacherRuns(tuple(results), trees)

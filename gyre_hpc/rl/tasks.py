"""Task suites of the rl workload beyond the harness's built-in ones.

``easy-3turn``: the easy tasks with three model calls per run (each output is appended to
the answer), for ``rollout.tool_latency_s`` to put environment time between calls.

``easy-tool``: the harness's ``easy`` tasks plus one test that stands for environment time:
it sleeps a lognormal time (median ``TOOL_MEDIAN_S``, sigma ``TOOL_SIGMA``) drawn from a hash
of the answer, so different runs wait different times, the same answer always the same.
That is the regime the elastic scheduler is for: on a small machine the rollout tail is
spent waiting on the environment, and the engines idle while it lasts. ``gyre-hpc bench e2e``
runs it; the simulator is fed the same distribution through the measured run.
"""
from __future__ import annotations

from dataclasses import replace

from gyre_hpc.harness.tasks import Task, TaskTest, is_task_dir, load_suite, suite_names

TOOL_MEDIAN_S = 2.0
TOOL_SIGMA = 0.6


def _tool_test(median_s: float, sigma: float) -> TaskTest:
    code = (
        "import hashlib, math, time\n"
        "from statistics import NormalDist\n"
        "data = open('answer.txt', 'rb').read() if __import__('os').path.exists('answer.txt') else b''\n"
        "u = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), 'little') / 2**64\n"
        "z = NormalDist().inv_cdf(min(max(u, 1e-9), 1 - 1e-9))\n"
        f"time.sleep({median_s!r} * math.exp({sigma!r} * z))\n")
    return TaskTest("environment_time", code)


def with_tool_time(tasks: list[Task], median_s: float = TOOL_MEDIAN_S, sigma: float = TOOL_SIGMA) -> list[Task]:
    return [replace(t, task_id=f"{t.task_id}-tool", tests=t.tests + (_tool_test(median_s, sigma),)) for t in tasks]


RL_SUITES = {
    "easy-tool": lambda: with_tool_time(load_suite("easy")),
    # Three turns per run: with rollout.tool_latency_s the waits fall between model calls.
    "easy-3turn": lambda: [replace(t, task_id=f"{t.task_id}-3turn", max_turns=3) for t in load_suite("easy")],
}


def task_suite_names() -> list[str]:
    """Every name ``rollout.tasks`` may take: the rl suites here and the harness's."""
    return sorted(set(suite_names()) | set(RL_SUITES))


def load_tasks(name: str) -> list[Task]:
    """``rollout.tasks``: an rl suite here, a harness suite or a directory of tasks."""
    if name in RL_SUITES:
        return RL_SUITES[name]()
    if name not in suite_names() and not is_task_dir(name):
        raise ValueError(f"rollout.tasks={name!r} is not a task suite; valid suites: {', '.join(task_suite_names())}; "
                         f"or a directory of tasks (a path with a '/', e.g. ./{name})")
    return load_suite(name)

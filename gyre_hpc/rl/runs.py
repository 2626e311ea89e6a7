"""The runs of a step: which tasks, how many runs each, their ids and seeds.

A pure function of (config, step), so a relaunched fleet asks for the very same runs (same
ids, same seeds) and finds their journals and stored trees.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from gyre_hpc.config import RunConfig
from gyre_hpc.harness.tasks import Task


@dataclass(frozen=True)
class RunSpec:
    step: int
    group: int          # task slot k in the step: the advantage group
    index: int          # g within the group
    task: Task
    seed: int

    @property
    def run_id(self) -> str:
        return f"s{self.step:05d}-t{self.group}-g{self.index}"


def sample_runs(tasks: list[Task], cfg: RunConfig, step: int) -> list[RunSpec]:
    """The runs of ``step``: ``tasks_per_step`` tasks (seeded by run seed and step), G runs each.

    A pure function of (config, step), so a relaunched fleet asks for the very same runs
    (same ids, same seeds) and finds their journals and stored trees.
    """
    rc = cfg.rollout
    rng = np.random.default_rng([cfg.seed, step])
    k = rc.tasks_per_step
    picks = rng.permutation(len(tasks))[:k] if k <= len(tasks) else rng.integers(0, len(tasks), k)
    specs = []
    for slot, t in enumerate(picks):
        for g in range(rc.runs_per_task):
            digest = hashlib.blake2b(f"{cfg.seed}/{step}/{slot}/{g}".encode(), digest_size=8).digest()
            specs.append(RunSpec(step, slot, g, tasks[int(t)], int.from_bytes(digest, "little") >> 1))
    return specs

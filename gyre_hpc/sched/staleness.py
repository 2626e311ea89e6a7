"""When a rollout batch may start: the one rule that bounds off-policy lag.

Batch ``s`` is generated with the newest weights at its start and trained into version
``s + 1``. Starting it while the trainer's newest version is ``v`` means its data is
``s - v`` versions stale when it is trained. On-policy schedules (elastic, colocate) use a
bound of 0, so batch ``s`` waits until training of ``s - 1`` has produced version ``s``.
"""
from __future__ import annotations


def may_start_rollout(batch_step: int, policy_version: int, max_staleness: int) -> bool:
    if max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
    return batch_step - policy_version <= max_staleness


def staleness_bound(policy: object) -> int:
    """A policy's bound; a policy that does not declare one is on-policy (0)."""
    return int(getattr(policy, "max_staleness", 0))


def may_launch_batch(batch_step: int, policy_version: int, max_staleness: int, previous_all_started: bool) -> bool:
    """Whether batch ``batch_step`` may launch now: continuous async admission.

    A batch does not wait for the stragglers of the previous one: once every run of the
    previous batch has *started* (the harness pool is full), the next batch may launch and
    its runs start as places free, provided the staleness bound holds. With a bound of 0
    this is the on-policy rule (batch ``s`` waits for version ``s``, i.e. for batch ``s - 1``
    to be trained), so on-policy batches never overlap; with 1, batch ``s + 1`` rolls out
    while step ``s`` finishes and trains. The runtime and the simulator both ask this.
    """
    return previous_all_started and may_start_rollout(batch_step, policy_version, max_staleness)


def next_batch_waits(every_run_started: bool, next_batch: int, policy_version: int, max_staleness: int,
                     batches: int) -> bool:
    """Whether no run can start before the trainer's next update: every launched run has
    started, and batch ``next_batch`` (the next to launch; ``batches`` in all) is past the last
    or held back by the staleness bound. The policy's ``ClusterState.next_batch_waits``: the
    runtime and the simulator both ask this."""
    return every_run_started and (next_batch >= batches or not may_start_rollout(next_batch, policy_version,
                                                                                  max_staleness))

"""``scheduler.policy: scripted``: flip every elastic cell every step, alternating direction.

The substrate smoke test wants flips both ways, many times, with no dependence on load.
The wanted role is a pure function of (step, cell) (elastic cell c trains on steps where
step + c is even), so asking again later in the same step returns no further changes and
the simulator replays exactly the same schedule.
"""
from __future__ import annotations

from gyre_hpc.sched.state import CellKind, ClusterState, Policy, Role, RoleChange


def wanted_role(step: int, cell: int) -> Role:
    return Role.TRAIN if (step + cell) % 2 == 0 else Role.ROLLOUT


def scripted_policy(state: ClusterState) -> list[RoleChange]:
    changes = []
    for c in state.cells:
        if c.kind is not CellKind.ELASTIC or c.switching:
            continue
        want = wanted_role(state.step, c.cell)
        if c.role is not want:
            changes.append(RoleChange(cell=c.cell, to=want, reason=f"scripted: step {state.step}"))
    return changes


def make_policy() -> Policy:
    """Registry factory (``gyre_hpc.sched.registry``): the scripted policy takes no parameters."""
    return scripted_policy

"""Arithmetic every policy shares: which cells serve requests now, how fast trainers go.

Convention for a cell in the middle of a flip (``switching=True``): its ``role`` is the role
it is switching TO. A switching cell neither serves requests nor trains yet, but it is
counted as a future engine (or replica) so a policy does not order a second cell to cover
the same shortfall.
"""
from __future__ import annotations

from gyre_hpc.sched.state import CellKind, CellState, ClusterState, Role


def serving_engines(state: ClusterState) -> list[CellState]:
    """Cells decoding right now: ROLLOUT and not mid-flip (rollout-only cells included)."""
    return [c for c in state.cells if c.role is Role.ROLLOUT and not c.switching]


def arriving_engines(state: ClusterState) -> list[CellState]:
    """Cells that are engines now or will be once their current flip ends."""
    return [c for c in state.cells if c.role is Role.ROLLOUT]


def flippable(state: ClusterState, role: Role) -> list[CellState]:
    """Elastic cells now in ``role`` that a policy may flip: never core, never rollout-only,
    never a cell whose previous flip has not finished."""
    return [c for c in state.cells if c.kind is CellKind.ELASTIC and c.role is role and not c.switching]


def rollout_demand(state: ClusterState) -> int:
    """Requests the engines must be able to hold: what is queued or decoding now, and at
    least one slot per unfinished run, because a run that is in a tool call right now comes
    back with its next model call (an agent's main loop issues one call at a time)."""
    return max(state.inflight_requests + state.queued_requests, state.unfinished_runs)


def train_rate(cell: CellState, default_tokens_per_s: float) -> float:
    """A cell's training tokens/s as a replica; cells never measured use the default."""
    return cell.train_tokens_per_s if cell.train_tokens_per_s > 0 else default_tokens_per_s


def trainers_rate(state: ClusterState, default_tokens_per_s: float) -> float:
    """Training tokens/s of every cell that is, or is becoming, a replica."""
    return sum(train_rate(c, default_tokens_per_s) for c in state.cells if c.role is Role.TRAIN)

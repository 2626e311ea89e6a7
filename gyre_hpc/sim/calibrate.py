"""Fit workload figures so that chosen policies take the hours a reference reports.

Calibrate on what is known, predict what is claimed: the ``paper`` preset's two least
certain figures (per-stream decode speed and per-cell training speed) are fitted so the
*baselines* (async and colocate) take the paper's hours; elastic is then simulated with
the same workload and is a prediction. The fit is a Newton iteration in log space with a
finite-difference Jacobian (each evaluation simulates the target policies once), so it
needs as many knobs as targets.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.compare import scaled
from gyre_hpc.sim.workload import Workload


@dataclass(frozen=True)
class Fit:
    knobs: dict[str, float]        # field path -> fitted value
    hours: dict[str, float]        # policy -> simulated hours at the fit
    target_h: dict[str, float]
    evaluations: int

    @property
    def worst_error(self) -> float:
        return max(abs(self.hours[k] / self.target_h[k] - 1) for k in self.target_h)


def hours(w: Workload, policies: tuple[str, ...]) -> dict[str, float]:
    return {p: simulate(w, policy_for(w, p), p).total_h for p in policies}


def fit(w: Workload, knobs: dict[str, float], target_h: dict[str, float], tol: float = 0.01,
        max_iter: int = 8, step: float = 0.05) -> Fit:
    """Values of ``knobs`` (field path -> starting value) that make each policy of
    ``target_h`` take its hours within ``tol`` (relative)."""
    names, policies = list(knobs), tuple(target_h)
    if len(names) != len(policies):
        raise ValueError(f"fit needs as many knobs ({', '.join(names)}) as targets ({', '.join(policies)})")
    goal = np.log([target_h[p] for p in policies])
    evals = 0

    def f(x: np.ndarray) -> np.ndarray:
        nonlocal evals
        evals += 1
        h = hours(scaled(w, **{n: float(np.exp(v)) for n, v in zip(names, x)}), policies)
        return np.log([h[p] for p in policies])

    x = np.log([knobs[n] for n in names])
    y = f(x)
    jac = np.empty((len(policies), len(names)))
    for j in range(len(names)):
        dx = np.zeros(len(names))
        dx[j] = step
        jac[:, j] = (f(x + dx) - y) / step
    for _ in range(max_iter):
        if np.max(np.abs(np.exp(y - goal) - 1)) <= tol:
            break
        move = np.linalg.lstsq(jac, goal - y, rcond=None)[0]
        move = np.clip(move, -0.7, 0.7)  # at most a factor of 2 a step
        y_new = f(x + move)
        # Broyden update: the Jacobian learns from the step it just took
        jac += np.outer((y_new - y) - jac @ move, move) / float(move @ move)
        x, y = x + move, y_new
    values = {n: float(np.exp(v)) for n, v in zip(names, x)}
    return Fit(knobs=values, hours=dict(zip(policies, np.exp(y).tolist())), target_h=dict(target_h),
               evaluations=evals)

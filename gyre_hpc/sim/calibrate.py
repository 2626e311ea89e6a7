"""Fit one figure so a reference policy takes the hours a reference reports, inside its prior.

Calibrate on what is known and let the fit fail: the ``paper`` preset fits one figure (its
``PAPER_FITTED`` prior) so that *colocate* takes the paper's 91.5 h, and nothing else; the
paper's async hours are then a check (which splits reproduce them) and elastic a
prediction. A fit that needs a value outside the figure's documented prior raises
``FitError`` naming the prior and what each end of it gives, so a wrong prior elsewhere
shows up instead of being absorbed into an impossible rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gyre_hpc.sim.cluster import policy_for, simulate
from gyre_hpc.sim.compare import scaled
from gyre_hpc.sim.priors import Prior
from gyre_hpc.sim.workload import Workload


class FitError(ValueError):
    """The reference hours need a fitted figure outside its prior."""


@dataclass(frozen=True)
class Fit:
    path: str
    value: float
    hours: float
    target_h: float
    policy: str
    evaluations: int
    inside_prior: bool

    @property
    def error(self) -> float:
        return abs(self.hours / self.target_h - 1)


def hours(w: Workload, policies: tuple[str, ...]) -> dict[str, float]:
    return {p: simulate(w, policy_for(w, p), p).total_h for p in policies}


def fit(w: Workload, prior: Prior, target_h: float, policy: str = "colocate", start: float | None = None,
        tol: float = 0.01, max_iter: int = 8, strict: bool = True) -> Fit:
    """The value of ``prior.path`` (inside ``[prior.low, prior.high]``) at which ``policy``
    takes ``target_h`` hours within ``tol``: secant steps on log hours against log value,
    from ``start`` (default the workload's own value). With ``strict``, a target outside what
    the prior's range gives raises ``FitError``; otherwise the fit stops at the nearer end
    with ``inside_prior=False``."""
    evals = 0

    def h(v: float) -> float:
        nonlocal evals
        evals += 1
        return hours(scaled(w, **{prior.path: v}), (policy,))[policy]

    def fail() -> Fit:
        lo, hi = h(prior.low), h(prior.high)
        msg = (f"{policy} at {target_h:.2f} h needs {prior.path} outside its prior [{prior.low:g}, {prior.high:g}] "
               f"({prior.why}): it gives {lo:.1f} h at {prior.low:g} and {hi:.1f} h at {prior.high:g}; "
               f"move that prior, or another figure's, for the fit to hold")
        if strict:
            raise FitError(msg)
        end = min((prior.low, lo), (prior.high, hi), key=lambda x: abs(math.log(x[1] / target_h)))
        return Fit(prior.path, end[0], end[1], target_h, policy, evals, False)

    x0 = math.log(start if start is not None else _value(w, prior.path))
    y0 = math.log(h(math.exp(x0))) - math.log(target_h)
    if abs(math.exp(y0) - 1) <= tol:
        return Fit(prior.path, math.exp(x0), target_h * math.exp(y0), target_h, policy, evals,
                   prior.holds(math.exp(x0)))
    x1 = x0 + 0.1   # the secant finds the direction
    y1 = math.log(h(math.exp(x1))) - math.log(target_h)
    lo, hi = math.log(prior.low), math.log(prior.high)
    for _ in range(max_iter):
        if abs(math.exp(y1) - 1) <= tol:
            break
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
        if slope == 0.0:
            break
        x2 = min(max(x1 - y1 / slope, lo - 0.05), hi + 0.05)
        if (x2 <= lo - 0.05 or x2 >= hi + 0.05) and (x1 <= lo or x1 >= hi):
            return fail()
        x0, y0, x1 = x1, y1, x2
        y1 = math.log(h(math.exp(x1))) - math.log(target_h)
    value = math.exp(x1)
    if not prior.holds(value):
        return fail()
    return Fit(prior.path, value, target_h * math.exp(y1), target_h, policy, evals, True)


def _value(w: Workload, path: str) -> float:
    obj = w
    for part in path.split("."):
        obj = getattr(obj, part)
    return float(obj)

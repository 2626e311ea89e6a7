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


@dataclass(frozen=True)
class Move:
    """What one other prior would have to be for the reference policy to take the target hours."""
    path: str
    value: float                 # the figure now
    hours_low: float             # hours at the prior's low and high ends
    hours_high: float
    needed: float | None         # the value that gives the target (log-log interpolation); None: it does not move them
    inside_prior: bool

    def describe(self, prior: Prior) -> str:
        if self.needed is None:
            return f"{self.path} ({self.hours_low:.1f}-{self.hours_high:.1f} h across [{prior.low:g}, {prior.high:g}])"
        where = "inside" if self.inside_prior else "OUTSIDE"
        return f"{self.path} {self.value:g} -> {self.needed:.4g} ({where} [{prior.low:g}, {prior.high:g}])"


def moves_to_reach(w: Workload, priors: tuple[Prior, ...], target_h: float, policy: str = "colocate") -> list[Move]:
    """For each prior, one at a time with the rest as ``w`` holds them: the value at which
    ``policy`` takes ``target_h`` hours, interpolated (log hours against log value) between
    the prior's ends and the current value, or extrapolated past the nearer end; ``None``
    when moving it changes the hours the wrong way or not at all. Two simulations a prior."""
    here = hours(w, (policy,))[policy]
    out = []
    for p in priors:
        now = field_value(w, p.path)
        pts = sorted({(p.low, hours(scaled(w, **{p.path: p.low}), (policy,))[policy]), (now, here),
                      (p.high, hours(scaled(w, **{p.path: p.high}), (policy,))[policy])})
        lo_h, hi_h = pts[0][1], pts[-1][1]
        needed = None
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if min(y0, y1) <= target_h <= max(y0, y1) and y0 != y1:
                needed = _loglog(x0, y0, x1, y1, target_h)
                break
        if needed is None:
            # past an end: extrapolate the outer segment whose hours move toward the target
            for (x0, y0), (x1, y1), end in ((pts[-2], pts[-1], pts[-1]), (pts[1], pts[0], pts[0])):
                if x0 != x1 and y0 != y1 and abs(math.log(y1 / y0)) > 1e-4 and (target_h - end[1]) * (y1 - y0) > 0:
                    needed = _loglog(x0, y0, x1, y1, target_h)
                    break
        if needed is not None and not p.low / 10 <= needed <= p.high * 10:
            needed = None   # the hours barely move with it: an extrapolation that far means nothing
        out.append(Move(p.path, now, lo_h, hi_h, needed, needed is not None and p.holds(needed)))
    return out


def _loglog(x0: float, y0: float, x1: float, y1: float, y: float) -> float:
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return math.exp(math.log(x0) + math.log(y / y0) / slope)


def fit(w: Workload, prior: Prior, target_h: float, policy: str = "colocate", start: float | None = None,
        tol: float = 0.01, max_iter: int = 8, strict: bool = True, others: tuple[Prior, ...] = ()) -> Fit:
    """The value of ``prior.path`` (inside ``[prior.low, prior.high]``) at which ``policy``
    takes ``target_h`` hours within ``tol``: secant steps on log hours against log value,
    from ``start`` (default the workload's own value). With ``strict``, a target outside what
    the prior's range gives raises ``FitError``, which with ``others`` (the preset's other
    priors) also says what each of them would have to be, the fitted figure at its nearer
    end (``moves_to_reach``); otherwise the fit stops at the nearer end with
    ``inside_prior=False``."""
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
        end = min((prior.low, lo), (prior.high, hi), key=lambda x: abs(math.log(x[1] / target_h)))
        if strict and others:
            moves = moves_to_reach(scaled(w, **{prior.path: end[0]}), others, target_h, policy)
            by_path = {p.path: p for p in others}
            msg += (f". With {prior.path} at {end[0]:g}, {target_h:.2f} h needs one of: "
                    + "; ".join(m.describe(by_path[m.path]) for m in moves if m.needed is not None)
                    + ". Not reachable by: " + ("; ".join(m.describe(by_path[m.path]) for m in moves if m.needed is None)
                                                 or "none"))
        if strict:
            raise FitError(msg)
        return Fit(prior.path, end[0], end[1], target_h, policy, evals, False)

    x0 = math.log(start if start is not None else field_value(w, prior.path))
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


def field_value(w: Workload, path: str) -> float:
    obj = w
    for part in path.split("."):
        obj = getattr(obj, part)
    return float(obj)

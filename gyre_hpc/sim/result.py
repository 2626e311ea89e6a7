"""What one simulation of one policy produced: the figures, and the rows a run directory gets."""
from __future__ import annotations

from dataclasses import dataclass, field

from gyre_hpc.rundir.metrics import EngineRow, EventRow, RunRow, StepRow, TimelineRow


@dataclass
class SimResult:
    policy: str
    workload: str
    total_s: float
    step_s: list[float]
    busy: dict[str, float]             # fraction of cell-seconds: rollout, train, switch, idle (sums to 1)
    switches: int
    runs_finished: int
    runs_cut: int                      # hit run.timeout_s
    tokens_trained: float
    events: int
    sim_wall_s: float                  # how long the simulation itself took
    # How full the engines were: resident sequences over slots (max_seqs), averaged over
    # serving time and over busy time, and KV held over KV capacity (0 if not modelled).
    occupancy: dict[str, float] = field(default_factory=dict)
    timeline: list[TimelineRow] = field(default_factory=list, repr=False)
    steps: list[StepRow] = field(default_factory=list, repr=False)
    engines: list[EngineRow] = field(default_factory=list, repr=False)
    events_log: list[EventRow] = field(default_factory=list, repr=False)
    runs: list[RunRow] = field(default_factory=list, repr=False)

    @property
    def total_h(self) -> float:
        return self.total_s / 3600.0

    def summary(self) -> dict:
        return {
            "policy": self.policy, "workload": self.workload, "total_h": round(self.total_h, 3),
            "total_s": round(self.total_s, 1),
            "mean_step_s": round(sum(self.step_s) / len(self.step_s), 1) if self.step_s else 0.0,
            "busy": {k: round(v, 4) for k, v in self.busy.items()},
            "occupancy": {k: round(v, 4) for k, v in self.occupancy.items()},
            "switches": self.switches, "runs_finished": self.runs_finished, "runs_cut": self.runs_cut,
            "tokens_trained": int(self.tokens_trained), "events": self.events,
            "sim_wall_s": round(self.sim_wall_s, 2),
        }

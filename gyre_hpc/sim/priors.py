"""The documented physical prior of every uncertain figure of a preset: its value, the range
it may take, and why. A fit stays inside the range of what it fits; a sensitivity sweep
moves every other figure to each end of its range (docs/sim.md has the reasoning)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prior:
    path: str          # the workload field, as ``--set`` spells it
    low: float
    high: float
    why: str

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise ValueError(f"prior {self.path}: need 0 < low <= high, got {self.low}, {self.high}")

    def holds(self, value: float) -> bool:
        return self.low * (1 - 1e-9) <= value <= self.high * (1 + 1e-9)


# The paper preset. The first is the one figure fitted (to colocate's hours only): the
# training rate, the figure with the widest documented uncertainty (the MFU of a 2.4T MoE's
# RL step at ~350K mean position) and real leverage on colocate (76-104 h across its range;
# the prefill's attention cost moves it only 82-85 h, too little to fit: docs/sim.md).
PAPER_FITTED = Prior("train.tokens_per_s", 1500.0, 3200.0, "16-35% MFU on 64 H800 at ~7e12 FLOP a token")
PAPER_PRIORS: tuple[Prior, ...] = (
    Prior("engine.prefill_ctx_tokens", 27_000.0, 80_000.0,
          "context position at which a prefill token's attention FLOPs equal its linear FLOPs: "
          "~27K from MLA's 7.4 MFLOP a position against 200 GFLOP a token, up to 3x that when "
          "the attention kernels run at a higher MFU than the expert GEMMs"),
    Prior("engine.single_seq_tokens_per_s", 60.0, 140.0,
          "a latency-bound expert-parallel decode step of 10-15 ms, x1-1.8 from MTP speculation"),
    Prior("engine.half_saturation_seqs", 128.0, 512.0, "batch at which reading every expert doubles the step"),
    Prior("engine.prefill_tokens_per_s", 90_000.0, 160_000.0, "30-50% MFU on 2 x 100B FLOP a token"),
    Prior("engine.gpu_bandwidth_gb_s", 2500.0, 3350.0, "achieved to peak HBM3 bandwidth of an H800"),
    Prior("run.tool_s.median", 3.0, 8.0, "shell commands and test runs"),
    Prior("run.calls.sigma", 0.3, 0.7, "the spread of turns per run"),
    Prior("train.optimizer_step_s", 30.0, 120.0, "the update of 2.4T sharded parameters and a commit"),
    Prior("train.weight_sync_s", 15.0, 60.0, "2.4 TB of FP8 weights over InfiniBand"),
    Prior("train.dp_sync_overhead", 0.05, 0.2, "gradient all-reduce share of a replica's time"),
    Prior("train.state_bytes_per_param", 12.0, 16.0,
          "bf16 weights and gradients, fp32 master weights; Adam moments in bf16 (DeepSeek-V3) or fp32"),
)
# The tiny preset (the notebooks' sample): no reference hours; its sensitivity refits to
# the base's own colocate hours, so the band shows how the policies move with the priors.
TINY_FITTED = Prior("engine.single_seq_tokens_per_s", 20.0, 120.0, "a small model's decode on a CPU or a GPU")
TINY_PRIORS: tuple[Prior, ...] = (
    Prior("train.tokens_per_s", 1000.0, 4000.0, "illustrative"),
    Prior("run.tool_s.median", 1.0, 4.0, "illustrative"),
)
PRIORS: dict[str, tuple[Prior, tuple[Prior, ...]]] = {"paper": (PAPER_FITTED, PAPER_PRIORS),
                                                      "tiny": (TINY_FITTED, TINY_PRIORS)}
# Hours a preset's fitted figure is fitted to (colocate's, from its source); a preset
# without one refits to its own base colocate hours.
REFERENCE_COLOCATE_H: dict[str, float] = {"paper": 91.5}

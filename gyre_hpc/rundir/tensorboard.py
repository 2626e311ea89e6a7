"""TensorBoard event files mirroring the ``steps`` and ``engines`` rows of ``metrics.h5``.

Users watch training in TensorBoard; ``metrics.h5`` stays the source (the loader, notebooks
and resume read it), so this is a write-only copy that a failed or deleted ``tensorboard/``
folder never affects. Tags: ``train/<column>`` at the training step, and
``engine/cell<N>/<column>`` at whole seconds since ``origin_s`` (engine figures are sampled
on a clock, not per step; a relaunched fleet keeps the same origin, so its points line up).
Non-finite values (a step without rewards) are left out rather than drawn as gaps.
"""
from __future__ import annotations

import math
from pathlib import Path

from gyre_hpc.rundir.metrics import EngineRow, StepRow, read_table

STEP_TAGS = ("loss", "reward_mean", "tokens", "wall_s", "replicas", "policy_version", "logprob_gap_max",
             "logprob_gap_mean", "pre_update_clip_share", "behaviour_kl")
ENGINE_TAGS = ("tokens_per_s", "queued", "inflight", "tokens_inflight")


class TensorBoardMirror:
    """Writes StepRow and EngineRow figures with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, logdir: str | Path, origin_s: float):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.logdir = Path(logdir)
        self.origin_s = origin_s
        self._writer = SummaryWriter(log_dir=str(self.logdir))

    def append(self, rows: list) -> None:
        wrote = False
        for row in rows:
            if isinstance(row, StepRow):
                wrote |= self._scalars("train", STEP_TAGS, row, row.step, row.time)
            elif isinstance(row, EngineRow):
                step = max(0, int(row.time - self.origin_s))
                wrote |= self._scalars(f"engine/cell{row.cell}", ENGINE_TAGS, row, step, row.time)
        if wrote:
            self._writer.flush()   # a live TensorBoard sees each step as it lands

    def _scalars(self, prefix: str, tags: tuple[str, ...], row, step: int, walltime: float) -> bool:
        wrote = False
        for tag in tags:
            value = float(getattr(row, tag))
            if math.isfinite(value):
                self._writer.add_scalar(f"{prefix}/{tag}", value, global_step=int(step), walltime=walltime)
                wrote = True
        return wrote

    def close(self) -> None:
        self._writer.close()


def run_origin_s(metrics_path: str | Path, default: float) -> float:
    """The run's first recorded event time (stable across relaunches), else ``default``."""
    path = Path(metrics_path)
    if path.exists():
        times = read_table(path, "events")["time"]
        if len(times):
            return float(times.min())
    return default

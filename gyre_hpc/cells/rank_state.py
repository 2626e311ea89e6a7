"""What the fleet needs of a cell rank's state, and nothing of what the rank computes.

A flip moves ``state_dict`` (received in place, so the model sees the new weights), a flip
that makes a rank join or leave training mid-step drops its partial gradients
(``zero_grads``), and a checkpoint holds what ``save`` writes and ``load`` reads back. What a
workload computes with that state (the substrate's rounds, RL's engines and micro-batches)
goes through its own commands and rank handler (``cell_rank.RankHandler``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from gyre_hpc.cells import checkpoint


class RankState(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that define the weights; receiving into them in place must update the model."""

    def zero_grads(self) -> None:
        """Drop the gradients accumulated so far (a rank joining or leaving TRAIN mid-step)."""

    def applied_updates(self) -> int:
        """Optimizer updates the state holds (applied here, received with it, or loaded): a
        join in place checks it against the core's before training on it."""

    def weights_version(self) -> int:
        """Optimizer updates the weights hold, at least ``applied_updates``: more when weights
        arrived without the moments (an engine's push). A join that keeps its own moments
        checks ``applied_updates``; a weights-only join (``protocol.Flip.weights_only``) this."""

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        """Write the state a checkpoint holds into ``directory`` (the core leader only)."""

    def load(self, directory: str | Path) -> None:
        """Load what ``save`` wrote, checking names, shapes and dtypes."""


def load_into(local: dict, stored: dict, where: Path) -> None:
    """Copy ``stored`` into the tensors of ``local``; a name, shape or dtype mismatch names the tensor."""
    missing = sorted(set(local) - set(stored))
    extra = sorted(set(stored) - set(local))
    if missing or extra:
        raise checkpoint.CheckpointError(
            f"checkpoint {where}: tensors missing {missing}, unexpected {extra} for this model")
    for name, t in local.items():
        src = stored[name]
        if src.shape != t.shape or src.dtype != t.dtype:
            raise checkpoint.CheckpointError(
                f"checkpoint {where}: {name} is {src.dtype}{list(src.shape)}, the model has "
                f"{t.dtype}{list(t.shape)}")
        t.copy_(src)

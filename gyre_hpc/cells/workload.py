"""What a cell rank computes, behind the small interface the fleet drives.

The fleet (controller + cell ranks) knows nothing of models, only of this interface: train
one micro-batch (accumulating gradients), hand over gradient tensors for averaging, apply
the averaged update, roll out, and expose the state dict that moves on a flip and goes into
checkpoints. The e2e trainer and engines plug in behind the same methods.

``SubstrateWorkload`` is the workload of the substrate smoke test: a few Linear layers plus
ballast buffers sized by ``model.substrate_state_mb`` so a flip moves a realistic number of
bytes; data is random but seeded by (step, micro-batch), so the gradient of a step does not
depend on which replica computed which micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from gyre_hpc.cells import checkpoint
from gyre_hpc.config import RunConfig


@dataclass(frozen=True)
class MicroResult:
    loss: float
    tokens: int


class Workload(Protocol):
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors that define the weights; receiving into them in place must update the model."""

    def train_micro_batch(self, step: int, micro_batch: int) -> MicroResult:
        """Forward/backward one micro-batch, adding to the accumulated gradients."""

    def grad_tensors(self) -> list[torch.Tensor]:
        """Accumulated gradients (summed over this rank's micro-batches), same order on every rank."""

    def zero_grads(self) -> None: ...

    def apply_update(self, step: int) -> None:
        """Optimizer step with the (already averaged) gradients."""

    def rollout(self, step: int, round_: int) -> int:
        """A slice of rollout work; returns tokens produced."""

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        """Write the state a checkpoint holds into ``directory`` (the core leader only)."""

    def load(self, directory: str | Path) -> None:
        """Load what ``save`` wrote, checking names, shapes and dtypes."""


class SubstrateModel(nn.Module):
    """An MLP plus ballast buffers; the ballast rides along in the state dict only.

    Ballast is split over float32 and bfloat16 buffers (and an int64 counter) so every flip
    exercises mixed dtypes; it is a buffer, not a parameter, so it does not inflate the
    gradient allreduce.
    """

    def __init__(self, dim: int = 128, depth: int = 3, ballast_mb: float = 0.0, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(dim, dim), nn.Tanh()]
        layers.append(nn.Linear(dim, 1))
        self.net = nn.Sequential(*layers)
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / dim ** 0.5))
        ballast_bytes = int(ballast_mb * (1 << 20))
        n32 = (ballast_bytes * 3 // 4) // 4
        n16 = (ballast_bytes - n32 * 4) // 2
        self.register_buffer("ballast_f32", torch.randn(n32, generator=gen))
        self.register_buffer("ballast_bf16", torch.randn(n16, generator=gen).to(torch.bfloat16))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class SubstrateWorkload:
    rows_per_micro_batch = 64

    def __init__(self, cfg: RunConfig):
        torch.manual_seed(cfg.seed)
        self.cfg = cfg
        self.model = SubstrateModel(ballast_mb=cfg.model.substrate_state_mb, seed=cfg.seed)
        self.lr = cfg.train.lr
        self.zero_grads()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=False)

    def _batch(self, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + micro_batch)
        x = torch.randn(self.rows_per_micro_batch, self.model.dim, generator=gen)
        y = torch.sin(x[:, 0]) + 0.5 * x[:, 1]
        return x, y

    def train_micro_batch(self, step: int, micro_batch: int) -> MicroResult:
        x, y = self._batch(step, micro_batch)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        return MicroResult(loss=float(loss.detach()), tokens=x.shape[0])

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters()]

    def zero_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def apply_update(self, step: int) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(p.grad, alpha=-self.lr)
            self.model.updates.add_(1)
        self.zero_grads()

    def rollout(self, step: int, round_: int) -> int:
        x, _ = self._batch(step, 10_000 + round_)
        with torch.no_grad():
            for _ in range(4):
                self.model(x)
        return x.shape[0] * 4

    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        checkpoint.write_state(Path(directory), self.state_dict())

    def load(self, directory: str | Path) -> None:
        load_into(self.state_dict(), checkpoint.load_state(Path(directory)), Path(directory))


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

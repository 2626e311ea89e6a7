"""The substrate (smoke) workload's rank state and compute: a few Linear layers plus ballast.

Ballast buffers sized by ``model.substrate_state_mb`` make a flip move a realistic number of
bytes; data is random but seeded by (step, micro-batch), so the gradient of a step does not
depend on which replica computed which micro-batch. It tests the fleet (flips, checkpoints,
gradient sync, faults) without models, engines or trees.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gyre_hpc.cells import checkpoint
from gyre_hpc.cells.rank_state import load_into
from gyre_hpc.config import RunConfig


@dataclass(frozen=True)
class MicroResult:
    loss: float
    tokens: int


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
        self.micro_batches += 1
        return MicroResult(loss=float(loss.detach()), tokens=x.shape[0])

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters()]

    def zero_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.micro_batches = 0      # the gradients and their count are one state

    def applied_updates(self) -> int:
        return int(self.model.updates.item())

    def weights_version(self) -> int:
        return self.applied_updates()   # its weights only ever move with the whole state

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

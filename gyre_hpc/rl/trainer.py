"""What a TRAIN rank runs: the decoder + AdamW + the tree loss on packed rows.

State that moves on a flip. A replica joining the training communicator must apply
*identical* updates to the other replicas, so it needs the model weights AND the AdamW
moments (and step count) of the core cell. ``state_dict()`` therefore returns both, under
``model.*`` and ``optim.*`` names: the fleet's flip machinery (``CellRank.flip`` ->
``weights.bcast_state_dict``) moves whatever that dict holds, in place. The optimizer state is
created eagerly (zeros, step 0) so every tensor exists before the first step and the dict
has the same names and shapes on every rank, trained or not.

Gradient weighting. The loss module's contract is "sum over tokens of
1/(run tokens x runs in the step)". The streaming trainer sees a step's runs group by group
(a group's advantages exist once its G runs are done), before the step's run count is known.
So micro-batches are computed with per-run weights ``1/run tokens`` (``StepWeights`` with
``n_runs=1``), replicas' gradients are summed (allreduce), and the sum is divided by the
step's run count once at the end: the same gradient as the full-batch loss, exactly. Under
``train.averaging: global`` every target weighs 1 in a micro-batch and the sum is divided
by the step's targets instead (``trees.loss.step_denominator``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gyre_hpc import fsio
from gyre_hpc.config import RunConfig
from gyre_hpc.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from gyre_hpc.models.decoder import CausalLM, build_model
from gyre_hpc.models.tokenizer import ChatTokenizer, embedded_tokenizer, load_tokenizer
from gyre_hpc.trees.chunked import backward_packed
from gyre_hpc.trees.loss import LogprobGap, StepWeights
from gyre_hpc.trees.packing import PackedRow, collate

OPTIMIZER_FILE = "optimizer.safetensors"


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one micro-batch and the per-run figures their loss needs (pickled to a replica)."""

    step: int
    mb_id: int
    rows: tuple[PackedRow, ...]
    advantages: np.ndarray      # float64 [R], R = runs referenced by the rows' sample_run
    run_tokens: np.ndarray      # int64 [R], targets of each run under train.shared_targets
    averaging: str = "run"      # train.averaging

    @property
    def tokens(self) -> int:
        return sum(r.n_tokens for r in self.rows)

    @property
    def loss_tokens(self) -> int:
        return sum(r.n_loss_tokens for r in self.rows)

    def weights(self) -> StepWeights:
        # n_runs=1 (total_tokens=1): the 1/(runs in step) (1/(targets in step)) factor is
        # applied once, after the allreduce.
        return StepWeights(self.advantages, self.run_tokens, 1, self.averaging, total_tokens=1)


@dataclass(frozen=True)
class TrainResult:
    """One micro-batch trained: its loss share, its trained tokens, and its logprob gap
    (computed with the weights the step's update starts from: no update happens within a step)."""

    loss: float
    tokens: int
    gap: LogprobGap


def initial_model(cfg: RunConfig) -> CausalLM:
    if cfg.model.path:
        return load_pretrained(cfg.model.path, dtype=torch.float32)
    return build_model(cfg.model.preset, seed=cfg.seed)


def policy_tokenizer(cfg: RunConfig) -> ChatTokenizer:
    """The policy's tokenizer: the checkpoint's own for ``model.path``, else the embedded default."""
    return load_tokenizer(cfg.model.path) if cfg.model.path else embedded_tokenizer()


class RLTrainer:
    """One replica's model and optimizer; the model is shared with the cell's engine."""

    def __init__(self, cfg: RunConfig, model: CausalLM | None = None):
        self.cfg = cfg
        self.model = model if model is not None else initial_model(cfg)
        self.tokenizer = policy_tokenizer(cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.train.lr, betas=(0.9, 0.99), weight_decay=0.0)
        for p in self.params:
            self.opt.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        self._weights_received = 0
        self.zero_grads()

    # ---- what moves on a flip and goes into checkpoints ---------------------------------
    def optimizer_state(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in zip(self.names, self.params):
            for key, t in self.opt.state[p].items():
                out[f"optim.{name}.{key}"] = t
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weights and optimizer moments; receiving into these tensors in place updates both."""
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        out.update(self.optimizer_state())
        return out

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    # ---- training -----------------------------------------------------------------------
    @property
    def attention(self) -> str:
        """The tree attention: the invariant kernel under ``model.numerics: invariant`` (the
        engine's numbers, bit for bit), else ``train.attention``."""
        return "invariant" if self.cfg.model.numerics == "invariant" else self.cfg.train.attention

    def train_micro_batch(self, mb: MicroBatch) -> TrainResult:
        batch = collate(list(mb.rows))
        gap = LogprobGap()
        # A row longer than train.row_tokens (a tree deeper than a row) trains in chunks of it.
        loss = backward_packed(self.model, batch, mb.weights(), self.cfg.train.clip_eps, self.attention,
                               chunk_tokens=self.cfg.train.row_tokens, gap=gap,
                               checkpoint_layers=self.cfg.train.activation_checkpointing)
        return TrainResult(loss=loss, tokens=mb.loss_tokens, gap=gap)

    def grad_tensors(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params]

    def zero_grads(self) -> None:
        for p in self.params:
            p.grad = torch.zeros_like(p)

    def applied_updates(self) -> int:
        """AdamW's step count: it travels with the state (flips, checkpoints)."""
        return int(self.opt.state[self.params[0]]["step"].item()) if self.params else 0

    def weights_version(self) -> int:
        """The updates the weights hold: the moments' count, or a later version received
        into the weights alone (``weights_received``)."""
        return max(self.applied_updates(), self._weights_received)

    def weights_received(self, version: int) -> None:
        """The model's tensors were just overwritten with ``version``'s weights, not its moments."""
        self._weights_received = version

    @property
    def holds_moments(self) -> bool:
        """Whether the optimizer moments belong to the weights (so an update may be applied here)."""
        return self.applied_updates() == self.weights_version()

    def apply_update(self, scale: float) -> None:
        """Optimizer step on the (summed) gradients times ``scale`` (1 / runs in the step)."""
        with torch.no_grad():
            for g in self.grad_tensors():
                g.mul_(scale)
        self.opt.step()
        self.zero_grads()

    # ---- checkpoints --------------------------------------------------------------------
    def save(self, directory: str | Path, extra: dict | None = None) -> None:
        """HF-format model directory plus the optimizer state beside it."""
        from safetensors.torch import save_file

        save_pretrained(self.model, directory, extra=extra, tokenizer=self.tokenizer)
        tensors = {k: v.detach().contiguous().clone() for k, v in self.optimizer_state().items()}
        with fsio.naming_full_disk(Path(directory) / OPTIMIZER_FILE):
            save_file(tensors, str(Path(directory) / OPTIMIZER_FILE))

    def load(self, directory: str | Path) -> None:
        """Weights and optimizer state from a directory ``save`` wrote (names and shapes checked)."""
        from safetensors.torch import load_file

        from gyre_hpc.cells.rank_state import load_into

        stored = load_pretrained(directory, dtype=torch.float32).state_dict()
        path = Path(directory) / OPTIMIZER_FILE
        if not path.is_file():
            raise CheckpointError(f"checkpoint {directory}: {OPTIMIZER_FILE} is missing")
        incoming = {f"model.{k}": v for k, v in stored.items()} | load_file(str(path))
        with torch.no_grad():
            load_into(self.state_dict(), incoming, Path(directory))


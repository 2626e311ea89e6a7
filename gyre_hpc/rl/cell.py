"""One cell rank of the RL fleet: an engine while ROLLOUT, a data-parallel replica while TRAIN.

With ``rollout.engine: torch`` the rank holds one model shared by its ``TorchEngine`` and its
``RLTrainer``, so a flip
moves nothing inside the rank: weights received from the core cell on ROLLOUT -> TRAIN land
in the tensors the engine decodes with later, and a cell that returns to ROLLOUT decodes
with the weights it trained. A ``VLLMEngine`` holds its own copy, which ``load_weights``
refreshes from the trainer's tensors whenever the policy version changes (the same calls).

While ROLLOUT the rank sits in ``mpi_engines.serve_engine`` on the engine communicator
(requests, token streams, KV migration). The controller pauses it (engine op ``stop``; the
engine and its sequences stay) whenever every rank must meet in a world-wide collective
(a flip's ``Comm.Split``), and sends ``Serve`` to resume. Flips themselves are
``cells.cell_rank.CellRank.flip``: re-derived train_comm, chunked weight (and optimizer
state) broadcast from the core cell to the joiners.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from mpi4py import MPI

from gyre_hpc.cells import gradsync, protocol, weights
from gyre_hpc.cells.cell_rank import CellRank
from gyre_hpc.engines.mpi_engines import serve_engine
from gyre_hpc.engines.base import Engine
from gyre_hpc.cells.plan import core_cell
from gyre_hpc.rl import messages
from gyre_hpc.rl.trainer import RLTrainer
from gyre_hpc.sched.state import Role


@dataclass
class RLCellRank:
    cell_rank: CellRank          # flips, communicators, the trainer as its workload
    trainer: RLTrainer
    engine: Engine
    engine_comm: MPI.Intracomm

    @property
    def world(self) -> MPI.Intracomm:
        return self.cell_rank.world

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    def serve(self) -> int:
        while True:
            cmd = protocol.wait_command(self.world)
            if isinstance(cmd, protocol.Stop):
                return cmd.code
            reply = self.handle(cmd)
            if reply is not None:
                self.world.send(reply, dest=0, tag=protocol.TAG_REPLY)

    def handle(self, cmd):
        if isinstance(cmd, messages.Serve):
            if self.engine.policy_version != cmd.policy_version:
                # Its weights are current (it trained them or was just sent them); the
                # engine only learns which version they are.
                self.engine.load_weights(self.trainer.model_state(), cmd.policy_version)
            serve_engine(self.engine, self.engine_comm)
            return None
        if isinstance(cmd, protocol.Flip):
            return self.cell_rank.flip(cmd)
        if isinstance(cmd, messages.Train):
            return self.train(cmd.micro_batch)
        if isinstance(cmd, messages.Finish):
            return self.finish(cmd)
        if isinstance(cmd, messages.SaveRL):
            if self.rank == core_cell(self.cell_rank.cells).leader:
                self.trainer.save(cmd.directory, extra=cmd.extra)
            return protocol.Ack(self.rank)
        raise TypeError(f"rl cell rank {self.rank}: unknown command {type(cmd).__name__}")

    def train(self, mb) -> messages.TrainReport:
        if self.cell_rank.cell.role is not Role.TRAIN:
            raise RuntimeError(f"rank {self.rank} got micro-batch {mb.mb_id} of step {mb.step} while ROLLOUT")
        t0 = time.perf_counter()
        res = self.trainer.train_micro_batch(mb)
        return messages.TrainReport(self.rank, mb.step, mb.mb_id, res.loss, mb.tokens, time.perf_counter() - t0)

    def finish(self, cmd: messages.Finish) -> messages.FinishReport:
        t0 = time.perf_counter()
        # weight 1 per replica: the mean times the replica count is the SUM the loss module asks for.
        stats = gradsync.allreduce_mean(self.trainer.grad_tensors(), self.cell_rank.rank_comms.train, weight=1.0)
        self.trainer.apply_update(stats.total_weight / max(cmd.n_runs, 1))
        self.engine.load_weights(self.trainer.model_state(), cmd.policy_version)
        is_core = self.rank == core_cell(self.cell_rank.cells).leader
        state = {k: v.detach().clone() for k, v in self.trainer.model_state().items()} if is_core else None
        checksum = weights.state_checksum(self.trainer.state_dict()) if cmd.checksums else None
        return messages.FinishReport(self.rank, time.perf_counter() - t0, stats.total_weight, state, checksum)

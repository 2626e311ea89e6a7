"""The RL workload on a cell rank: an engine while ROLLOUT, a data-parallel replica while TRAIN.

With ``rollout.engine: torch`` the rank holds one model shared by its ``TorchEngine`` and its
``RLTrainer`` (the fleet's rank workload), so a flip moves nothing inside the rank: weights
received from the core cell on ROLLOUT -> TRAIN land in the tensors the engine decodes with
later, and a cell that returns to ROLLOUT decodes with the weights it trained. A
``VLLMEngine`` holds its own copy, which ``load_weights`` refreshes from the trainer's tensors
whenever the policy version changes (at the same points: a broadcast received, an update).

``RLRankHandler`` answers the RL commands inside the fleet's one serve loop
(``cells.cell_rank.CellRank``); flips, checkpoints and the stop are the fleet's. On ``Serve``
the rank acknowledges and then sits in ``engines.mpi_engines.serve_engine`` on the engine
communicator (requests, token streams, KV migration) until the controller pauses it (engine
op ``stop``; the engine and its sequences stay), which it does whenever every rank must meet
in a world-wide collective (a flip's ``Comm.Split``).
"""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass

from mpi4py import MPI

from gyre_hpc.cells import gradsync, protocol, weights
from gyre_hpc.cells.cell_rank import CellRank
from gyre_hpc.engines.mpi_engines import serve_engine
from gyre_hpc.engines.base import Engine
from gyre_hpc.engines.pacing import TrainPace
from gyre_hpc.rl import messages
from gyre_hpc.rl.batches import StoreMicroBatches
from gyre_hpc.rl.trainer import RLTrainer
from gyre_hpc.sched.state import Role


@dataclass
class RLRankHandler:
    trainer: RLTrainer
    engine: Engine
    engine_comm: MPI.Intracomm
    micro_batches: StoreMicroBatches
    weights_channel: weights.WeightsChannel | None = None
    # cells.device: paced: each micro-batch ends no earlier than its tokens at the modelled
    # rate (emulated; overruns recorded in pace.pacer.record)
    pace: TrainPace | None = None

    def __post_init__(self) -> None:
        if self.weights_channel is None:
            self.weights_channel = weights.WeightsChannel(self.engine_comm)

    def adopt(self, version: int) -> None:
        """The trainer's tensors now hold ``version``: an engine decoding with those very
        tensors only learns the version; one with its own copy (vLLM) reloads it."""
        if getattr(self.engine, "model", None) is self.trainer.model:
            self.engine.adopt_weights(version)
        else:
            self.engine.load_weights(self.trainer.model_state(), version)

    def recv_weights(self, payload) -> dict:
        """Engine side of ``PushWeights``, at the engine's safe point: into the model's own
        tensors (shared with this rank's trainer), then the engine decodes as ``version``."""
        version, members = payload
        stats = self.weights_channel.receive(self.trainer.model_state(), tuple(members))
        self.trainer.weights_received(version)
        self.adopt(version)
        return {"bytes": stats.bytes, "seconds": stats.seconds, "version": version}

    def handle(self, cell_rank: CellRank, cmd):
        if isinstance(cmd, messages.Serve):
            if self.engine.policy_version != cmd.policy_version:
                # Its weights are current (it trained them or was just sent them); the
                # engine only learns which version they are.
                self.engine.load_weights(self.trainer.model_state(), cmd.policy_version)
            cell_rank.reply(protocol.Ack(cell_rank.rank))
            serve_engine(self.engine, self.engine_comm, ops={"recv_weights": self.recv_weights})
            return None
        if isinstance(cmd, messages.PushWeights):
            stats = self.weights_channel.push(self.trainer.model_state(), cmd.members)
            return messages.WeightsReport(cell_rank.rank, stats.seconds, stats.bytes)
        if isinstance(cmd, messages.Train):
            return self.train(cell_rank, cmd.micro_batch, cmd.replicas)
        if isinstance(cmd, messages.Finish):
            return self.finish(cell_rank, cmd)
        raise TypeError(f"rl cell rank {cell_rank.rank}: unknown command {type(cmd).__name__}")

    def train(self, cell_rank: CellRank, mb, replicas: int = 1) -> messages.TrainReport:
        if cell_rank.cell.role is not Role.TRAIN:
            raise RuntimeError(f"rank {cell_rank.rank} got micro-batch {mb.mb_id} of step {mb.step} while ROLLOUT")
        t0 = time.perf_counter()
        started = self.pace.pacer.clock() if self.pace is not None else 0.0
        res = self.trainer.train_micro_batch(self.micro_batches.get(mb))
        if self.pace is not None:
            self.pace.pacer.hold(started, self.pace.micro_batch_s(mb.tokens, replicas))
        return messages.TrainReport(cell_rank.rank, mb.step, mb.mb_id, res.loss, mb.tokens, time.perf_counter() - t0,
                                    res.gap, self.pace.pacer.record.as_dict() if self.pace is not None else None,
                                    resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

    def finish(self, cell_rank: CellRank, cmd: messages.Finish) -> messages.FinishReport:
        t0 = time.perf_counter()
        members = cell_rank.meet_train(cmd.roles) if cmd.roles else None
        # weight 1 per replica: the mean times the replica count is the SUM the loss module asks for.
        stats = gradsync.allreduce_mean(self.trainer.grad_tensors(), cell_rank.rank_comms.train, weight=1.0)
        moments = self.trainer.holds_moments
        if moments:
            self.trainer.apply_update(stats.total_weight / max(cmd.n_runs, 1))
        else:
            self.trainer.zero_grads()   # its moments are an older version's: the core's weights follow
        if cmd.weights_from_core:
            # train_comm has the core leader first (``comms.RankComms``)
            weights.bcast_into(self.trainer.model_state(), cell_rank.rank_comms.train,
                               chunk_bytes=cell_rank.chunk_bytes)
            if not moments:
                self.trainer.weights_received(cmd.policy_version)
        elif not moments:
            raise RuntimeError(f"rank {cell_rank.rank}: step {cmd.step}'s update came without the core's weights, "
                               f"but this rank holds no optimizer moments for its weights to apply it")
        # A TorchEngine decodes with these very tensors: it only learns their version.
        self.adopt(cmd.policy_version)
        # A weights-only rank's moments are not the core's: only its weights are checked.
        checksum = weights.state_checksum(self.trainer.state_dict()) if cmd.checksums and moments else None
        weights_checksum = weights.state_checksum(self.trainer.model_state()) if cmd.checksums else None
        return messages.FinishReport(cell_rank.rank, time.perf_counter() - t0, stats.total_weight, checksum, members,
                                     weights_checksum)

"""The substrate workload on a cell rank: its rounds and the step's end, inside the fleet's
one serve loop (``cells.cell_rank.CellRank``; flips, checkpoints and the stop are the fleet's).

A TRAIN rank accumulates the gradients of the micro-batches it is assigned; a ROLLOUT rank
runs a slice of rollout work per round. At ``EndStep`` the replicas average their gradients,
weighted by how many micro-batches each trained, and check that together they trained every
micro-batch the controller planned: a replica that joined or left mid-step dropped its share
in the flip (``zero_grads``), and the controller had another replica redo it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from gyre_hpc.cells import gradsync, protocol, weights
from gyre_hpc.cells.cell_rank import CellRank
from gyre_hpc.sched.state import Role
from gyre_hpc.substrate import messages
from gyre_hpc.substrate.workload import SubstrateWorkload


@dataclass
class SubstrateRankHandler:
    workload: SubstrateWorkload

    def handle(self, rank: CellRank, cmd):
        if isinstance(cmd, (messages.BeginStep, messages.AbortStep)):
            self.workload.zero_grads()
            return protocol.Ack(rank.rank)
        if isinstance(cmd, messages.Round):
            return self.round(rank, cmd)
        if isinstance(cmd, messages.EndStep):
            return self.end_step(rank, cmd)
        raise TypeError(f"substrate cell rank {rank.rank}: unknown command {type(cmd).__name__}")

    def round(self, rank: CellRank, cmd: messages.Round) -> messages.RoundReport:
        t0 = time.perf_counter()
        losses: dict[int, float] = {}
        tokens = rollout_tokens = 0
        if rank.cell.role is Role.TRAIN:
            for mb in cmd.assign.get(rank.rank, ()):
                res = self.workload.train_micro_batch(cmd.step, mb)
                losses[mb] = res.loss
                tokens += res.tokens
        else:
            rollout_tokens = self.workload.rollout(cmd.step, cmd.round)
        return messages.RoundReport(rank=rank.rank, losses=losses, tokens=tokens,
                                    rollout_tokens=rollout_tokens, seconds=time.perf_counter() - t0)

    def end_step(self, rank: CellRank, cmd: messages.EndStep) -> messages.EndReport:
        t0 = time.perf_counter()
        if rank.cell.role is Role.TRAIN:
            grads = self.workload.grad_tensors()
            n = self.workload.micro_batches
            if n:
                for g in grads:
                    g.div_(n)
            stats = gradsync.allreduce_mean(grads, rank.rank_comms.train, weight=float(n))
            if int(round(stats.total_weight)) != cmd.micro_batches:
                raise RuntimeError(f"step {cmd.step}: replicas trained {stats.total_weight:g} micro-batches, "
                                   f"the controller planned {cmd.micro_batches}")
            self.workload.apply_update(cmd.step)
        checksum = weights.state_checksum(self.workload.state_dict()) if cmd.checksums else None
        return messages.EndReport(rank=rank.rank, seconds=time.perf_counter() - t0, checksum=checksum)

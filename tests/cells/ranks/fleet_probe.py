"""Rank program: the real fleet (run_fleet) with state checksums on, a chosen policy and
workload; rank 0 dumps the FleetResult as JSON.

Modes: ``scripted`` (the config's policy); ``midstep`` (cell 1 joins at round 1 of odd
steps and leaves at round 1 of even steps, so flips land inside steps); ``never`` (no flips:
the reference for midstep); ``fail`` (rank 2 raises during step 2); ``exit`` (the core
leader drops control/checkpoint-and-exit during step 2, as the supervisor would); ``stall``
(rank 2 sleeps through step 2 without failing; the controller's reply timeout is 8 s).
"""
import dataclasses
import json
import sys
from pathlib import Path

from gyre_hpc.cells.rank_env import prepare_rank_env

prepare_rank_env()   # before MPI starts, like the real entry point

from gyre_hpc.cells.controller import FleetResult
import dataclasses as dc  # noqa: E402

from gyre_hpc.cells.fleet import FleetOptions, exit_rank, guard_world, main_guarded, run_fleet
from gyre_hpc.substrate.fleet import SUBSTRATE
from gyre_hpc.substrate.workload import SubstrateWorkload
from gyre_hpc.sched.state import Role, RoleChange

run_dir, out_path, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
chunk_bytes = int(sys.argv[4]) if len(sys.argv) > 4 else 32 << 20


class FailingWorkload(SubstrateWorkload):
    def __init__(self, cfg, rank):
        super().__init__(cfg)
        self.rank = rank

    def rollout(self, step, round_):
        if step == 2 and self.rank == 2:
            raise RuntimeError("injected failure on rank 2")
        return super().rollout(step, round_)

    def train_micro_batch(self, step, micro_batch):
        if step == 2 and self.rank == 2:
            raise RuntimeError("injected failure on rank 2")
        return super().train_micro_batch(step, micro_batch)


class StallingWorkload(SubstrateWorkload):
    def __init__(self, cfg, rank):
        super().__init__(cfg)
        self.rank = rank

    def rollout(self, step, round_):
        if step == 2 and self.rank == 2:     # cell 1 rolls out in step 2
            import time
            time.sleep(120)        # alive, never answering: only the reply timeout ends this
        return super().rollout(step, round_)


class ExitRequestingWorkload(SubstrateWorkload):
    def __init__(self, cfg, rank):
        super().__init__(cfg)
        self.rank = rank

    def train_micro_batch(self, step, micro_batch):
        if step == 2 and self.rank == 1:
            (run_dir / "control").mkdir(exist_ok=True)
            (run_dir / "control" / "checkpoint-and-exit").touch()
        return super().train_micro_batch(step, micro_batch)


def midstep_policy():
    calls = {}

    def policy(state):
        n = calls[state.step] = calls.get(state.step, -1) + 1
        if n == 1:   # the second consultation of a step is at round 1: mid-step
            return [RoleChange(cell=1, to=Role.TRAIN if state.step % 2 else Role.ROLLOUT, reason="midstep")]
        return []
    return policy


options = {
    "scripted": FleetOptions(SUBSTRATE, verify_weights=True, chunk_bytes=chunk_bytes),
    "midstep": FleetOptions(SUBSTRATE, verify_weights=True, policy=midstep_policy(), chunk_bytes=chunk_bytes),
    "never": FleetOptions(SUBSTRATE, verify_weights=True, policy=lambda state: [], chunk_bytes=chunk_bytes),
    "fail": FleetOptions(workload=dc.replace(SUBSTRATE, rank_workload=FailingWorkload)),
    "exit": FleetOptions(workload=dc.replace(SUBSTRATE, rank_workload=ExitRequestingWorkload), verify_weights=True),
    "stall": FleetOptions(workload=dc.replace(SUBSTRATE, rank_workload=StallingWorkload), reply_timeout_s=8.0),
}[mode]

if mode in ("fail", "exit", "stall"):
    code = exit_rank(main_guarded(run_dir, options))
    sys.exit(code)
out = guard_world(lambda: run_fleet(run_dir, options), "fleet probe")   # a broken rank ends the test run
if isinstance(out, FleetResult):
    with open(out_path, "w") as f:
        json.dump(dataclasses.asdict(out), f, default=str)

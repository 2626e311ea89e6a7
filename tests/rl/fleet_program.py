"""An RL fleet rank with a test-chosen policy: ``mpiexec -n N python fleet_program.py RUN_DIR [--policy P]``.

``--policy migrate`` is the run config's policy plus one forced release per step: the first
time an elastic ROLLOUT engine holds requests mid-decode, it is flipped to TRAIN, so its
sequences must move with their KV cache (``migrate-hold``: it trains until the update, and the
steps take turns among the engines). Whether the elastic policy itself releases a cell
while it still decodes depends on timing; this makes the migration path run every time.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import dataclasses  # noqa: E402
import time  # noqa: E402

from gyre_hpc.cells.fleet import main_guarded  # noqa: E402
from gyre_hpc.config import load_config  # noqa: E402
from gyre_hpc.rl.fleet import rl_options, rl_workload  # noqa: E402
from gyre_hpc.rl.rank import RLRankHandler  # noqa: E402
from gyre_hpc.rundir.layout import RunDir  # noqa: E402
from gyre_hpc.sched.registry import policy_from_config  # noqa: E402
from gyre_hpc.sched.state import CellKind, ClusterState, Role, RoleChange  # noqa: E402


class ReleaseWhileDecoding:
    """Wraps a policy; once per step releases the first elastic engine holding in-flight requests.

    ``hold``: the released cell trains until its step's update (the inner policy's returns of
    it are dropped until the next step), and each step releases an engine the previous step
    did not, if one is busy: so one step's joiner is an engine that missed the last update."""

    def __init__(self, inner, hold: bool = False):
        self.inner, self.hold = inner, hold
        self.max_staleness = getattr(inner, "max_staleness", 0)
        self.released: dict[int, int] = {}     # step -> the cell released in it

    def __call__(self, state: ClusterState) -> list[RoleChange]:
        if state.step not in self.released:
            engines = [c for c in state.cells if c.role is Role.ROLLOUT and not c.switching]
            busy = [c for c in engines if c.kind is CellKind.ELASTIC and c.inflight_requests > 0]
            busy.sort(key=lambda c: self.hold and c.cell == self.released.get(state.step - 1))
            if busy and len(engines) > 1:
                self.released[state.step] = busy[0].cell
                return [RoleChange(busy[0].cell, Role.TRAIN, "test: release while decoding")]
        changes = self.inner(state)
        if self.hold:
            changes = [ch for ch in changes if ch.cell != self.released.get(state.step)]
        return changes


class StallingHandler(RLRankHandler):
    """Rank 1 (the core replica) takes its first micro-batch and never answers: alive, silent."""

    def train(self, cell_rank, mb, replicas=1):
        if cell_rank.rank == 1:
            time.sleep(300)
        return super().train(cell_rank, mb, replicas)


def stalling_fleet(run_dir: str, reply_timeout_s: float) -> int:
    wl = rl_workload()

    def handler(fs, cell_rank):
        h = wl.rank_handler(fs, cell_rank)
        return StallingHandler(h.trainer, h.engine, h.engine_comm, h.micro_batches)

    options = rl_options(reply_timeout_s=reply_timeout_s)
    options = dataclasses.replace(options, workload=dataclasses.replace(wl, rank_handler=handler))
    return main_guarded(run_dir, options)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--policy", choices=["config", "migrate", "migrate-hold"], default="config")
    parser.add_argument("--verify", action="store_true")
    parser.add_argument("--result", default=None, help="rank 0 writes the fleet result here (JSON)")
    parser.add_argument("--stall-timeout", type=float, default=None,
                        help="rank 1 never answers its first micro-batch; the controller's reply timeout (s)")
    args = parser.parse_args()
    if args.stall_timeout is not None:
        return stalling_fleet(args.run_dir, args.stall_timeout)
    cfg = load_config(RunDir.at(args.run_dir).config)
    policy = None
    if args.policy in ("migrate", "migrate-hold"):
        policy = ReleaseWhileDecoding(policy_from_config(cfg.scheduler), hold=args.policy == "migrate-hold")
    return main_guarded(args.run_dir, rl_options(policy=policy, verify_weights=args.verify,
                                                 result_path=args.result))


if __name__ == "__main__":
    sys.exit(main())

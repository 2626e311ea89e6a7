"""Lower bounds on a workload's time, whatever the policy: where a schedule stands against the limit.

Two bounds, each valid for every policy:
- **work**: all decode work at the engines' peak throughput (the largest batch) plus all
  training at the replicas' full speed (no all-reduce overhead), spread over every cell;
- **critical path**: each step's longest run with an engine to itself (single-stream
  decode, its tool time), plus the optimizer step, chained the way the staleness bound
  chains batches: batch ``s`` cannot start before step ``s - k - 1`` ended, so the steps
  ``r, r + k + 1, r + 2(k + 1), ...`` follow each other for every residue ``r``.
"""
from __future__ import annotations

from gyre_hpc.sim.batch import sample_batch
from gyre_hpc.sim.workload import Workload


def work_bound_s(w: Workload) -> float:
    e = w.engine
    peak = e.max_seqs * e.per_seq_tokens_per_s(e.max_seqs)   # at no KV: faster than any real batch
    decode = train = 0.0
    for s in range(w.steps):
        b = sample_batch(w, s)
        decode += sum(sum(x) for x in b.work)
        train += sum(sum(x) for x in b.tokens)
    return (decode / peak + train / w.train.tokens_per_s) / w.fleet.cells


def critical_path_s(w: Workload, max_staleness: int = 0) -> float:
    per_step = [max(sample_batch(w, s).critical_s) + w.train.optimizer_step_s for s in range(w.steps)]
    k = max_staleness + 1
    return max(sum(per_step[r::k]) for r in range(min(k, w.steps)))


def lower_bounds(w: Workload, staleness: dict[str, int]) -> dict:
    """The work bound, the critical path of each staleness in ``staleness`` (policy -> its
    bound), and each policy's bound (the larger of the two), all in hours."""
    work = work_bound_s(w)
    paths = {k: critical_path_s(w, k) for k in sorted(set(staleness.values()))}
    return {
        "work_h": round(work / 3600, 3),
        "critical_path_h": {f"staleness_{k}": round(v / 3600, 3) for k, v in paths.items()},
        "policy_bound_h": {p: round(max(work, paths[k]) / 3600, 3) for p, k in staleness.items()},
    }

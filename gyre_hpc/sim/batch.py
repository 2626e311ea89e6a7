"""One RL step's rollout batch, sampled once per (seed, step) so every policy gets the same runs.

Sampling is vectorised over all calls of the batch; the simulator then only walks lists.
Common random numbers across policies mean a difference between policies is the
policy's doing, not a luckier draw of run lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gyre_hpc.sim.workload import Workload


@dataclass
class Batch:
    step: int
    work: list[list[float]]    # per run, per simulated call: decode-token equivalents (prefill converted)
    tool_s: list[list[float]]  # per run, per simulated call: environment time after it
    tokens: list[list[float]]  # per run, per simulated call: tokens it adds to the trajectory tree
    ctx: list[list[float]]     # per run, per simulated call: context length while it decodes (KV held)
    group: list[int]           # per run: its task (advantage group) within the batch
    calls: list[int]           # per run: model calls before coarsening
    # per run, per simulated call: seconds from the start of that call to the run's end with
    # a whole engine to itself (single-stream decode, tool time between calls). The tail
    # ranking's expected remaining time, and [i][0] is the run's critical path.
    rest_s: list[list[float]]

    @property
    def runs(self) -> int:
        return len(self.work)


@lru_cache(maxsize=512)
def sample_batch(w: Workload, step: int) -> Batch:
    """The batch of step ``step`` (cached: the policies of one comparison share it; treat it
    as read-only)."""
    r, e = w.run, w.engine
    rng = np.random.default_rng([w.seed, step])
    n_runs = r.runs_per_step
    calls = np.maximum(1, np.rint(r.calls.sample(rng, n_runs))).astype(np.int64)
    total = int(calls.sum())
    out = r.output_tokens.sample(rng, total)
    ctx_new = r.context_tokens.sample(rng, total)
    tool = r.tool_s.sample(rng, total)
    prefill_equiv = e.single_seq_tokens_per_s / e.prefill_tokens_per_s
    tokens = out + ctx_new
    first_call = np.concatenate([[0], np.cumsum(calls)[:-1]])
    # Context while a call decodes: everything before it, its new prompt, half its output.
    run_offset = np.repeat(np.concatenate([[0.0], np.cumsum(tokens)])[first_call], calls)
    decode_ctx = np.cumsum(tokens) - run_offset - out / 2
    work = out * e.decode_slowdown(decode_ctx) + prefill_equiv * ctx_new

    # Merge every `coarsen` consecutive calls of a run into one simulated call: sums keep
    # each run's decode work, tokens and tool time, so run lengths and their tail are kept.
    m = r.coarsen
    blocks = -(-calls // m)
    local = np.arange(total) - np.repeat(first_call, calls)
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    key = np.repeat(first_block, calls) + local // m
    n_blocks = int(blocks.sum())

    def per_block(x: np.ndarray) -> list[list[float]]:
        summed = np.bincount(key, weights=x, minlength=n_blocks)
        return [a.tolist() for a in np.split(summed, np.cumsum(blocks)[:-1])]

    tok_blocks = per_block(tokens)
    ctx = [np.cumsum(t).tolist() for t in tok_blocks]
    work_blocks, tool_blocks = per_block(work), per_block(tool)
    rest = []
    for wb, tb in zip(work_blocks, tool_blocks):
        # no tool time after the last call: the run ends with it
        serial = np.asarray(wb) / e.single_seq_tokens_per_s + np.concatenate([tb[:-1], [0.0]])
        rest.append(np.cumsum(serial[::-1])[::-1].tolist())
    return Batch(step=step, work=work_blocks, tool_s=tool_blocks, tokens=tok_blocks, ctx=ctx,
                 group=(np.arange(n_runs) // r.runs_per_task).tolist(), calls=calls.tolist(), rest_s=rest)

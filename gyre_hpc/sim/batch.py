"""One RL step's rollout batch, sampled once per (seed, step) so every policy gets the same runs.

Sampling is vectorised over all calls of the batch; the simulator then only walks lists.
Common random numbers across policies mean a difference between policies is the
policy's doing, not a luckier draw of run lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from gyre_hpc.sim.workload import Workload, WorkloadError


@dataclass
class Batch:
    step: int
    work: list[list[float]]     # per run, per simulated call: tokens to decode
    prefill_s: list[list[float]]  # per run, per simulated call: seconds to prefill its new context (prefix cached)
    tool_s: list[list[float]]   # per run, per simulated call: environment time after it
    tokens: list[list[float]]   # per run, per simulated call: tokens it adds to the trajectory tree
    ctx: list[list[float]]      # per run, per simulated call: KV tokens it holds while it decodes (mean over its calls)
    group: list[int]            # per run: its task (advantage group) within the batch
    calls: list[int]            # per run: model calls before coarsening
    # per run: seconds from its first call to its end with an engine to itself (single-
    # stream decode, its prefills, tool time between calls). The critical-path BOUND only:
    # the simulator's policy inputs never read it (a controller cannot know it).
    critical_s: list[float]

    @property
    def runs(self) -> int:
        return len(self.work)


@lru_cache(maxsize=512)
def sample_batch(w: Workload, step: int) -> Batch:
    """The batch of step ``step``, drawn from the run shape of that step (``Workload.run_at``:
    the drift's multipliers there); cached, as the policies of one comparison share it:
    treat it as read-only."""
    r = w.run_at(step)
    rng = np.random.default_rng([w.seed, step])
    n_runs = r.runs_per_step
    calls = np.maximum(1, np.rint(r.calls.sample(rng, n_runs))).astype(np.int64)
    total = int(calls.sum())
    out = r.output_tokens.sample(rng, total)
    ctx_new = r.context_tokens.sample(rng, total)
    tool = r.tool_s.sample(rng, total)
    return build_batch(w, step, calls, out, ctx_new, tool, (np.arange(n_runs) // r.runs_per_task).tolist())


def build_batch(w: Workload, step: int, calls: np.ndarray, out: np.ndarray, ctx_new: np.ndarray, tool: np.ndarray,
                group: list[int]) -> Batch:
    """A batch from its runs' calls (per run) and per call: output tokens, new context tokens,
    environment time after it (sampled by ``sample_batch``; a real run's own by ``sim.trace``)."""
    r, e = w.run, w.engine
    total = int(calls.sum())
    tokens = out + ctx_new
    first_call = np.concatenate([[0], np.cumsum(calls)[:-1]])
    run_offset = np.repeat(np.concatenate([[0.0], np.cumsum(tokens)])[first_call], calls)
    before = np.cumsum(tokens) - run_offset - tokens       # context already cached when the call starts
    decode_ctx = before + ctx_new + out / 2                # context while it decodes, on average
    prefill = np.asarray(e.prefill_s(ctx_new, before))
    limit = e.max_context_tokens()
    if limit and float((before + tokens).max()) > limit:
        raise WorkloadError(f"a run reaches {int((before + tokens).max()):,} tokens of context, more than one "
                            f"engine holds for one sequence ({limit:,}: engine.attention_gpus={e.attention_gpus} "
                            f"GPUs of KV beside the weights); raise engine.attention_gpus or shorten the runs")

    # Merge every `coarsen` consecutive calls of a run into one simulated call: sums keep
    # each run's decode work, prefill, tokens and tool time, so run lengths and their tail are kept.
    m = r.coarsen
    blocks = -(-calls // m)
    local = np.arange(total) - np.repeat(first_call, calls)
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    key = np.repeat(first_block, calls) + local // m
    n_blocks = int(blocks.sum())

    def summed(x: np.ndarray) -> np.ndarray:
        return np.bincount(key, weights=x, minlength=n_blocks)

    def per_run(x: np.ndarray) -> list[list[float]]:
        return [a.tolist() for a in np.split(x, np.cumsum(blocks)[:-1])]

    out_b = summed(out)
    ctx_b = summed(out * decode_ctx) / np.maximum(out_b, 1e-12)
    tool_b, pre_b = summed(tool), summed(prefill)
    alone = summed(out * np.asarray(e.step_s(1, decode_ctx)) + prefill)
    last_block = np.cumsum(blocks) - 1
    serial = alone + tool_b
    serial[last_block] -= tool_b[last_block]   # no tool time after the last call: the run ends with it
    critical = np.add.reduceat(serial, first_block).tolist()
    return Batch(step=step, work=per_run(out_b), prefill_s=per_run(pre_b), tool_s=per_run(tool_b),
                 tokens=per_run(summed(tokens)), ctx=per_run(ctx_b),
                 group=list(group), calls=calls.tolist(), critical_s=critical)

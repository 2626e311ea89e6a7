"""``gyre-hpc bench trees``: tree training against per-path training, same model, same data.

Workload: synthetic long-horizon runs (``gyre_hpc.trees.synthetic``, ~200 calls each,
compressions, sub-agents, retries), one task group.

Baseline ("per_path"): every call's prompt+output is its own sequence, packed into the
same rows with document masking, run through the same kernel and the same loss. So the
only difference measured is prefix sharing, not padding or kernel choice.

``--from RUN``: the same comparison on a real run's own ``trees.zarr`` (its first ``--trees``
committed trees, one step's worth by default): the tree variant trains the stored trees,
the per-path variant every kept call's path on its own, each trained token in exactly one
path (the first call whose path holds its node), weighted as part of its run.

Each variant runs in a fresh spawned process (one torch thread) so its peak memory is its
own: peak RSS (``ru_maxrss``) minus RSS just before the step, i.e. what forward+backward
of the whole step added on top of model and data.

``--model PATH``: the step on a checkpoint folder's model (e.g. SmolLM2-135M) instead of the preset.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import resource
import time

import click
import numpy as np

from gyre_hpc.bench.mfu import attention_pairs, gemm_rate, step_flops
from gyre_hpc.bench.model_option import model_option
from gyre_hpc.report import emit


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _workload(n_runs: int, n_calls: int, seed: int):
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.synthetic import SyntheticConfig, synthetic_runs

    runs = synthetic_runs(n_tasks=1, runs_per_task=n_runs, cfg=SyntheticConfig(n_calls=n_calls), seed=seed)
    trees = [build_tree(r.journal, run_id=r.run_id, task_id=r.task_id, reward=r.reward) for r in runs]
    return runs, trees


def _store_trees(run_dir: str, n_trees: int):
    from gyre_hpc.rundir.layout import RunDir
    from gyre_hpc.trees.store import TreeStore

    with TreeStore.open(RunDir.at(run_dir).trees, "r") as store:
        n = min(n_trees, len(store))
        if n < 2:
            raise click.ClickException(f"bench trees --from {run_dir}: its trees.zarr commits {len(store)} trees, "
                                       f"need >= 2")
        return [store.read(i) for i in range(n)]


def _stored_per_path(trees):
    """Every kept call of every stored tree as its own one-node tree (see module docstring)."""
    from gyre_hpc.trees.loss import StepWeights
    from gyre_hpc.trees.model import Tree

    paths, owner = [], []
    for r, tree in enumerate(trees):
        owned = np.zeros(tree.n_nodes, dtype=bool)
        for c in range(tree.n_paths):
            nodes = tree.node_path(c)
            first = [not owned[n] for n in nodes]      # this call is the first whose path holds the node
            owned[nodes] = True
            idx = np.concatenate([np.arange(tree.node_start[n], tree.node_start[n] + tree.node_len[n]) for n in nodes])
            mask = np.repeat(np.array(first, dtype=bool), tree.node_len[nodes])
            trained = tree.trained[idx] & mask
            role = tree.call_role[c]
            paths.append(Tree(tokens=tree.tokens[idx], logprobs=np.where(trained, tree.logprobs[idx], 0).astype(np.float32),
                              trained=trained, node_start=np.zeros(1, np.int64), node_len=np.array([idx.size], np.int32),
                              parent=np.array([-1], np.int32), node_role=np.array([role], np.int8),
                              call_node=np.zeros(1, np.int32), call_role=np.array([role], np.int8),
                              call_agent=[tree.call_agent[c]], run_id=tree.run_id, task_id=tree.task_id,
                              reward=tree.reward))
            owner.append(r)
    owner = np.asarray(owner)
    run_weights = StepWeights.from_trees(trees)
    return paths, StepWeights(run_weights.advantages[owner], run_weights.run_tokens[owner], run_weights.n_runs)


def _per_path(runs, trees):
    """One single-call tree per call, weighted as part of its run (per-run averaging kept)."""
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.loss import StepWeights

    paths, owner = [], []
    for r, run in enumerate(runs):
        for call in run.journal:
            paths.append(build_tree([call], run_id=run.run_id, task_id=run.task_id, reward=run.reward))
            owner.append(r)
    owner = np.asarray(owner)
    run_weights = StepWeights.from_trees(trees)
    run_tokens = np.bincount(owner, weights=[int(p.trained.sum()) for p in paths], minlength=len(runs))
    return paths, StepWeights(run_weights.advantages[owner], run_tokens.astype(np.int64)[owner],
                              int((run_tokens > 0).sum()))


def _measure(variant: str, n_runs: int, n_calls: int, seed: int, preset: str, row_tokens: int, queue,
             from_run: str | None = None, n_trees: int = 16, model_path: str | None = None) -> None:
    """Child process: build the data, then time one full step (forward+backward, all rows)."""
    import torch

    from gyre_hpc.models.tiny_lm import build_model
    from gyre_hpc.trees.loss import StepWeights, packed_loss
    from gyre_hpc.trees.packing import collate, pack

    torch.set_num_threads(1)
    if from_run is not None:
        trees = _store_trees(from_run, n_trees)
        units, weights = (trees, StepWeights.from_trees(trees)) if variant == "tree" else _stored_per_path(trees)
    else:
        runs, trees = _workload(n_runs, n_calls, seed)
        if variant == "tree":
            units, weights = trees, StepWeights.from_trees(trees)
        else:
            units, weights = _per_path(runs, trees)
    rows = pack(units, row_tokens)
    batches = [collate([row]) for row in rows]
    if model_path is not None:
        from gyre_hpc.bench.model_option import load_model

        model = load_model(model_path)
    else:
        model = build_model(preset, seed=seed)
    if from_run is not None and int(max(int(u.tokens.max()) for u in units)) >= model.config.vocab_size:
        raise click.ClickException(f"bench trees --from {from_run}: token ids exceed "
                                   f"{model_path or 'preset ' + repr(preset)}'s vocabulary")
    rss_before = _rss_bytes()
    t0 = time.perf_counter()
    loss = 0.0
    for batch in batches:
        step_loss = packed_loss(model, batch, weights, clip_eps=0.2, attention="sdpa")
        step_loss.backward()
        loss += float(step_loss.detach())
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    flops = step_flops(model.config, int(sum(r.n_tokens for r in rows)),
                       sum(attention_pairs(r.position_ids) for r in rows), int(sum(r.n_loss_tokens for r in rows)))
    queue.put({
        "flops": dataclasses.asdict(flops) | {"total": flops.total},
        "flop_s": flops.total / seconds,
        # Measured after the step, in the same process and thread count: the reference rate.
        "gemm": gemm_rate(model.config),
        "step_s": seconds,
        "peak_mem_mb": max(0, peak - rss_before) / 2**20,
        "rows": len(rows),
        "packed_tokens": int(sum(r.n_tokens for r in rows)),
        "trained_tokens": int(sum(r.n_loss_tokens for r in rows)),
        "loss": loss,
        "grad_norm": float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))),
    })


def _in_child(variant: str, **kwargs) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(variant,), kwargs={**kwargs, "queue": queue})
    proc.start()
    result = queue.get()
    proc.join()
    if proc.exitcode != 0:
        raise click.ClickException(f"bench trees: the {variant} measurement exited with {proc.exitcode}")
    return result


def _mfu(per_path: dict, tree: dict, gemms: list[dict]) -> dict:
    """Each variant's FLOP rate over the best GEMM rate any of the step's processes measured
    (the box is shared: the best is the least disturbed)."""
    gemm = max(gemms, key=lambda g: g["flop_s"])
    return {
        "per_path": per_path["flop_s"] / gemm["flop_s"],
        "tree": tree["flop_s"] / gemm["flop_s"],
        "gflop_s": {"per_path": per_path["flop_s"] / 1e9, "tree": tree["flop_s"] / 1e9,
                    "gemm": gemm["flop_s"] / 1e9},
        "flops": {"per_path": per_path["flops"], "tree": tree["flops"]},
        "gemm": {k: v for k, v in gemm.items() if k != "flop_s"},
        "what": "model FLOPs (projections, attention over visible pairs, head over trained tokens; backward "
                "= 2 x forward; recomputation not counted) per second of the step, over torch.matmul's rate "
                "at the model's shapes in the model's mix, same thread count, best of the run's processes "
                "(gyre_hpc.bench.mfu)",
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--runs", "n_runs", default=2, show_default=True, help="runs in the step (one task group)")
@click.option("--calls", "n_calls", default=200, show_default=True, help="model calls per run")
@click.option("--preset", default="tiny", show_default=True, help="model preset (gyre_hpc.models.tiny_lm.PRESETS)")
@model_option
@click.option("--row-tokens", default=4096, show_default=True, help="tokens per packed row (micro-batch)")
@click.option("--repeats", default=2, show_default=True,
              help="measure each variant this many times, interleaved; the fastest counts (shared CPUs are noisy)")
@click.option("--seed", default=0, show_default=True)
@click.option("--from", "from_run", type=click.Path(file_okay=False), default=None,
              help="measure on this run directory's trees.zarr instead of synthetic runs")
@click.option("--trees", "n_trees", default=16, show_default=True, help="with --from: the first N committed trees")
def command(as_json: bool, n_runs: int, n_calls: int, preset: str, model_path: str | None, row_tokens: int,
            repeats: int, seed: int, from_run: str | None, n_trees: int) -> None:
    """Tokens, step time and peak memory: tree training vs per-path training."""
    if from_run is not None:
        trees = _store_trees(from_run, n_trees)
        expanded = sum(int(t.path(c).size) for t in trees for c in range(t.n_paths))
        n_runs, n_calls = len(trees), sum(t.n_paths for t in trees) / len(trees)
    else:
        runs, trees = _workload(n_runs, n_calls, seed)
        expanded = sum(c.prompt.size + c.output.size for r in runs for c in r.journal)
    in_tree = sum(t.n_tokens for t in trees)
    kwargs = dict(n_runs=n_runs, n_calls=int(n_calls), seed=seed, preset=preset, row_tokens=row_tokens,
                  from_run=from_run, n_trees=n_trees, model_path=model_path)
    if n_runs < 2:
        raise click.BadParameter(
            "needs >= 2 runs: one run alone has zero group-normalised advantage", param_hint="--runs")
    if repeats < 1:
        raise click.BadParameter("must be >= 1", param_hint="--repeats")
    measured: dict[str, list[dict]] = {"per_path": [], "tree": []}
    for _ in range(repeats):
        for variant in measured:
            measured[variant].append(_in_child(variant, **kwargs))
    per_path, tree = (min(measured[v], key=lambda m: m["step_s"]) for v in ("per_path", "tree"))
    emit({
        "workload": {
            "runs": n_runs, "calls_per_run": n_calls, "model": model_path or preset, "row_tokens": row_tokens, "repeats": repeats,
            "generator": (f"the first {n_runs} trees of {from_run}/trees.zarr" if from_run else
                          "gyre_hpc.trees.synthetic defaults (compressions, sub-agents, retries)"),
        },
        "tokens": {
            "expanded_paths": int(expanded),
            "tree": int(in_tree),
            "ratio": expanded / in_tree,
            "packed_rows_per_path": per_path["packed_tokens"],
            "packed_rows_tree": tree["packed_tokens"],
        },
        "step_time_s": {
            "per_path": per_path["step_s"],
            "tree": tree["step_s"],
            "ratio": per_path["step_s"] / tree["step_s"],
            "what": "forward+backward of every row of the step, sdpa backend, 1 torch thread, fastest of repeats",
        },
        "peak_mem_mb": {
            "per_path": per_path["peak_mem_mb"],
            "tree": tree["peak_mem_mb"],
            "ratio": per_path["peak_mem_mb"] / max(tree["peak_mem_mb"], 1e-9),
            "what": "peak RSS (ru_maxrss) minus RSS before the step, each variant in its own process",
        },
        "mfu": _mfu(per_path, tree, [m["gemm"] for v in measured.values() for m in v]),
        "rows": {"per_path": per_path["rows"], "tree": tree["rows"]},
        "trained_tokens": {"per_path": per_path["trained_tokens"], "tree": tree["trained_tokens"]},
        "loss": {"per_path": per_path["loss"], "tree": tree["loss"]},
    }, as_json)

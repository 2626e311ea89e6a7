"""``gyre-hpc bench engines``: TorchEngine vs VLLMEngine vs raw ``vllm.LLM.generate`` on one model.

The cases (contract 4; TorchEngine is optimised against them): one thread, the ``small``
preset, greedy, the same weights in every engine:
  (a) 1 stream, 256 prompt + 256 new tokens;
  (b) 16 streams, 512 prompt + 128 new tokens each, submitted together;
  (c) prefill of 4K and 16K tokens (one new token).
Figures: tokens/s (new tokens for a, b; prompt tokens for c) of each engine, the ratios
VLLMEngine / raw vLLM (the adapter's overhead: 1 - ratio) and VLLMEngine / TorchEngine, and
whether the three produced the same tokens. TorchEngine runs twice: ``torch`` in its default
invariant mode (``models.invariant``: bitwise logprobs in any batch, the trainer's) and
``torch_native`` on the library's kernels; ``invariant_cost`` is native tokens/s over
invariant tokens/s (the price of bitwise on-policy logprobs; target <= 1.3 on the batch case). Raw vLLM runs on the adapter's own ``LLM`` (same
weights, same warm state) with the same sampling work (``logprobs=0``, no detokenising), and
the prefix cache is reset before every timed run so no run is served by an earlier one.
``--model PATH`` runs every engine on a checkpoint folder's own weights instead (e.g. SmolLM2-135M
from ``gyre-hpc models import-gguf``); the default cases it cannot hold are left out and named.
Each figure is the best of ``--repeats`` runs, the order of the three rotating from run to
run (noise on a shared machine only slows a run; measured: the adapter's own Python costs
~0.04 ms of a 2-3 ms decode step, so run-to-run noise dominates the overhead figure).
"""
from __future__ import annotations

import os
import tempfile
import time

import click

from gyre_hpc.bench.model_option import max_position, model_option

CASES = {"a_1x256+256": (1, 256, 256), "b_16x512+128": (16, 512, 128), "c_prefill_4k": (1, 4096, 1),
         "c_prefill_16k": (1, 16384, 1)}


def select_cases(case_names: str | None, scale: float, limit: int) -> tuple[dict, dict[str, str]]:
    """The cases to run (streams, prompt, new tokens; scaled) and the defaults left out, with why.

    Why defaults are dropped but named ones refused: SmolLM2 holds 8192 positions, so its
    default run leaves out the 16K prefill and says so, while asking for that case is an error.
    """
    names = case_names.split(",") if case_names else list(CASES)
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise click.BadParameter(f"{unknown}: valid cases are {', '.join(CASES)}", param_hint="--cases")
    cases = {c: (s, max(2, int(p * scale)), n if n == 1 else max(2, int(n * scale)))
             for c, (s, p, n) in CASES.items() if c in names}
    too_long = [c for c, (_, p, n) in cases.items() if p + n > limit]
    if too_long and case_names:
        raise click.BadParameter(f"{too_long}: longer than the model's max_position={limit}", param_hint="--cases")
    return ({c: v for c, v in cases.items() if c not in too_long},
            {c: f"longer than the model's max_position={limit}" for c in too_long})


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(7, vocab, (length,), generator=g).tolist()) for _ in range(n)]


def _run_engine(engine, prompts, new_tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    from gyre_hpc.engines import Request, SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, stop_token_ids=())
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(Request(f"r{i}-{t0}", p, params))
    outs = {}
    while engine.has_unfinished():
        engine.step()
        for o in engine.pop_finished():
            outs[o.request_id] = o.token_ids
    wall = time.perf_counter() - t0
    return wall, [outs[f"r{i}-{t0}"] for i in range(len(prompts))]


def _run_raw(llm, prompts, new_tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, logprobs=0, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, [tuple(o.outputs[0].token_ids) for o in outs]


def measure(preset: str, cases: dict[str, tuple[int, int, int]], repeats: int, model_path: str | None = None) -> dict:
    """The figures; with ``model_path`` on that checkpoint folder (its own weights in every engine)."""
    import torch

    from gyre_hpc.engines.torch_engine import TorchEngine
    from gyre_hpc.engines.vllm_engine import VLLMEngine
    from gyre_hpc.models.checkpoint import save_pretrained
    from gyre_hpc.models.decoder import build_model

    from gyre_hpc.bench.model_option import describe, load_model

    torch.set_num_threads(1)
    model = load_model(model_path) if model_path else build_model(preset, seed=0)
    longest = max(p + n for _, p, n in cases.values())
    # vLLM reserves its KV cache up front: the batch case's tokens at the model's bytes per token, and room.
    cfg = model.config
    kv_per_token = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_dim * 4
    kv_bytes = max(512 << 20, 2 * kv_per_token * max(s * (p + n) for s, p, n in cases.values()))
    with tempfile.TemporaryDirectory() as tmp:
        d = model_path or tmp
        if model_path is None:
            save_pretrained(model, d)
        torch_engine = TorchEngine(model, name="torch", max_batch=64)
        native_engine = TorchEngine(model, name="torch_native", max_batch=64, invariant=False)
        vllm_engine = VLLMEngine(d, name="vllm", max_model_len=longest + 16, max_num_seqs=64,
                                 kv_cache_memory_bytes=kv_bytes)
        llm = vllm_engine.llm
        warm = _prompts(2, 32, model.config.vocab_size, seed=99)
        _run_engine(torch_engine, warm, 8)
        _run_engine(native_engine, warm, 8)
        _run_engine(vllm_engine, warm, 8)
        _run_raw(llm, warm, 8)
        out: dict = {}
        for name, (streams, prompt_len, new) in cases.items():
            prompts = _prompts(streams, prompt_len, model.config.vocab_size, seed=prompt_len)
            counted = streams * (prompt_len if new == 1 else new)
            runners = [("vllm_raw", lambda: _run_raw(llm, prompts, new)),
                       ("vllm_engine", lambda: _run_engine(vllm_engine, prompts, new)),
                       ("torch", lambda: _run_engine(torch_engine, prompts, new)),
                       ("torch_native", lambda: _run_engine(native_engine, prompts, new))]
            best = {key: float("inf") for key, _ in runners}
            tokens = {}
            for r in range(repeats):
                # The order rotates so no engine always runs first (after the case's setup).
                shift = r % len(runners)
                for key, fn in runners[shift:] + runners[:shift]:
                    llm.reset_prefix_cache()
                    wall, toks = fn()
                    best[key] = min(best[key], wall)
                    tokens[key] = toks
            rate = {k: counted / v for k, v in best.items()}
            out[name] = {
                "streams": streams, "prompt_tokens": prompt_len, "new_tokens": new,
                "counted": "prompt tokens/s" if new == 1 else "new tokens/s",
                "tokens_per_s": {k: round(v, 1) for k, v in rate.items()},
                "wall_s": {k: round(v, 4) for k, v in best.items()},
                "vllm_engine_over_raw": round(rate["vllm_engine"] / rate["vllm_raw"], 4),
                "adapter_overhead": round(1 - rate["vllm_engine"] / rate["vllm_raw"], 4),
                "vllm_engine_over_torch": round(rate["vllm_engine"] / rate["torch"], 4),
                "invariant_cost": round(rate["torch_native"] / rate["torch"], 4),
                "tokens_identical": {"vllm_engine_vs_raw": tokens["vllm_engine"] == tokens["vllm_raw"],
                                     "torch_vs_vllm": tokens["torch"] == tokens["vllm_engine"],
                                     "torch_invariant_vs_native": tokens["torch"] == tokens["torch_native"]},
            }
        vllm_engine.close()
    overheads = [c["adapter_overhead"] for c in out.values()]
    batch = out.get("b_16x512+128", {}).get("invariant_cost")
    return {"preset": None if model_path else preset, "model": describe(model_path, model, preset), "threads": 1,
            "repeats": repeats, "cases": out,
            "max_adapter_overhead": max(overheads), "target_adapter_overhead": 0.10,
            "adapter_overhead_within_target": max(overheads) <= 0.10,
            "invariant_cost_batch": batch, "target_invariant_cost_batch": 1.3,
            "invariant_cost_within_target": None if batch is None else batch <= 1.3}


@click.command()
@click.option("--json", "as_json", is_flag=True, help="print JSON")
@click.option("--preset", default="small", show_default=True, help="model preset (gyre_hpc.models.decoder.PRESETS)")
@model_option
@click.option("--cases", "case_names", default=None,
              help=f"comma-separated subset of the cases [default: those of {', '.join(CASES)} the model's "
                   "positions hold]")
@click.option("--scale", default=1.0, show_default=True, type=click.FloatRange(0.001, 1.0),
              help="multiply every token count (for a quick look; contract figures need 1.0)")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 20))
def command(as_json: bool, preset: str, model_path: str | None, case_names: str | None, scale: float,
            repeats: int) -> None:
    """TorchEngine vs VLLMEngine vs raw vLLM: tokens/s and the adapter's overhead."""
    from gyre_hpc.models.decoder import PRESETS
    from gyre_hpc.report import emit

    if model_path is None and preset not in PRESETS:
        raise click.BadParameter(f"{preset!r}: valid presets are {', '.join(PRESETS)}", param_hint="--preset")
    limit = max_position(model_path) if model_path else PRESETS[preset].max_position
    cases, skipped = select_cases(case_names, scale, limit)
    # One OpenMP thread for vLLM's CPU backend too (contract 4), bound to one core.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    # vLLM logs to stdout by default: with --json, stdout carries the JSON object alone.
    if as_json:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    result = measure(preset, cases, repeats, model_path)
    if skipped:
        result["cases_skipped"] = skipped
    emit(result, as_json)

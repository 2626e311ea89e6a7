"""The engine benchmark cases (contract 4), measured on TorchEngine and on raw ``vllm.LLM``.

Cases, at one thread, greedy, the same weights in both engines: one stream of 256 prompt +
256 new tokens; 16 streams of 512 + 128; prefill of 4K and 16K tokens (one new token).
Throughput counts new tokens over the wall time of the whole case (prefill included), and
prompt tokens for the prefill cases. ``gyre-hpc bench engines`` (the model stack's command)
imports ``torch_engine_cases`` and ``vllm_cases``; ``python -m gyre_hpc.bench.engine_cases``
runs both and prints the comparison as JSON.

Why vLLM runs in a child process: its CPU worker binds OpenMP threads and then replaces
``torch.set_num_threads`` with a no-op for the whole process, which would leave the
TorchEngine figures measured under vLLM's thread settings.
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


def _figures(case: EngineCase, seconds: float, tokens: list[list[int]]) -> dict:
    work = case.streams * (case.prompt_len if case.prefill_only else case.new_tokens)
    return {"case": asdict(case), "seconds": seconds, "tokens_per_s": work / seconds,
            "unit": "prompt tokens/s" if case.prefill_only else "new tokens/s", "token_ids": tokens}


def torch_engine_cases(model, cases=DEFAULT_CASES, threads: int = 1, seed: int = 0, **engine_kwargs) -> dict:
    """Per case: seconds, tokens/s and the greedy token ids of a fresh TorchEngine over ``model``."""
    from gyre_hpc.engines import Request, SamplingParams
    from gyre_hpc.engines.torch_engine import TorchEngine

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = {}
        vocab = model.config.vocab_size
        warm = TorchEngine(model, name="warmup", **engine_kwargs)
        warm.generate(Request("w", tuple(case_prompts(EngineCase("w", 1, 64, 8), vocab)[0]),
                              SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=())))
        for case in cases:
            engine = TorchEngine(model, name=case.name, max_batch=max(case.streams, 1), **engine_kwargs)
            params = SamplingParams(max_new_tokens=case.new_tokens, temperature=0.0, stop_token_ids=())
            prompts = case_prompts(case, vocab, seed)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.submit(Request(f"s{i}", tuple(p), params))
            while engine.has_unfinished():
                engine.step()
            seconds = time.perf_counter() - t0
            done = {o.request_id: o for o in engine.pop_finished()}
            out[case.name] = _figures(case, seconds, [list(done[f"s{i}"].token_ids) for i in range(case.streams)])
        return {"engine": "TorchEngine", "threads": threads, "cases": out}
    finally:
        torch.set_num_threads(before)


def vllm_cases(model_dir: str, cases=DEFAULT_CASES, seed: int = 0, **llm_kwargs) -> dict:
    """The same cases through raw ``vllm.LLM.generate`` (one call per case, all streams at once).
    Threads are vLLM's: set ``OMP_NUM_THREADS=1`` and ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (one
    unpinned thread, like TorchEngine's) before import."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(c.prompt_len + c.new_tokens for c in cases)
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=seed,
              max_model_len=longest, max_num_seqs=max(c.streams for c in cases), enable_prefix_caching=False,
              gpu_memory_utilization=llm_kwargs.pop("gpu_memory_utilization", 0.1),
              **llm_kwargs)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    llm.generate([TokensPrompt(prompt_token_ids=case_prompts(EngineCase("w", 1, 64, 8), vocab)[0])],
                 SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False), use_tqdm=False)
    out = {}
    for case in cases:
        params = SamplingParams(max_tokens=case.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in case_prompts(case, vocab, seed)]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        out[case.name] = _figures(case, seconds, [list(r.outputs[0].token_ids) for r in results])
    return {"engine": "vllm.LLM.generate", "cases": out}


def compare(ours: dict, theirs: dict) -> dict:
    """Figures side by side: ``slower_by`` = their tokens/s over ours; tokens identical or not."""
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
                      "tokens_identical": a["token_ids"] == b["token_ids"], "tokens_matching": f"{same}/{total}",
                      "distinct_tokens": len({t for ts in a["token_ids"] for t in ts})}
    return rows


def _vllm_child(model_dir: str, case_names: list[str], out_path: str) -> None:
    cases = [c for c in DEFAULT_CASES if c.name in case_names]
    with open(out_path, "w") as f:
        json.dump(vllm_cases(model_dir, cases), f)


def main(argv: list[str] | None = None) -> dict:
    import argparse

    from gyre_hpc.models.checkpoint import save_pretrained
    from gyre_hpc.models.tiny_lm import build_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--cases", default=",".join(c.name for c in DEFAULT_CASES))
    ap.add_argument("--sharpen", type=float, default=8.0,
                    help="scale every weight matrix by this (the preset's random init has flat logits, so greedy "
                         "decoding would repeat one token and 'tokens identical' would prove nothing)")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu installed (default: skip vLLM)")
    ap.add_argument("--vllm-child", nargs=2, metavar=("MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - {c.name for c in DEFAULT_CASES})
    if unknown:
        ap.error(f"--cases: unknown {unknown}; valid cases are {', '.join(c.name for c in DEFAULT_CASES)}")
    if args.vllm_child:
        _vllm_child(args.vllm_child[0], names, args.vllm_child[1])
        return {}
    cases = [c for c in DEFAULT_CASES if c.name in names]
    model = build_model(args.preset, seed=0)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" not in pname:
                p.mul_(args.sharpen)
    result = {"benchmark": "engine_cases", "preset": args.preset, "head_dim": model.config.head_dim,
              "sharpen": args.sharpen,
              "baseline": "raw vllm.LLM.generate, same weights, greedy, one thread"}
    ours = torch_engine_cases(model, cases)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        if args.vllm_python:
            out = os.path.join(tmp, "vllm.json")
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind",
                       OMP_NUM_THREADS="1")
            proc = subprocess.run([args.vllm_python, "-m", "gyre_hpc.bench.engine_cases", "--cases", ",".join(names),
                                   "--vllm-child", tmp, out], env=env, capture_output=True, text=True)
            if proc.returncode == 0:
                with open(out) as f:
                    result["comparison"] = compare(ours, json.load(f))
            else:
                result["vllm_skipped"] = f"rc={proc.returncode}: {proc.stderr.strip()[-1500:]}"
    result["torch_engine"] = {n: {k: v for k, v in r.items() if k != "token_ids"} for n, r in ours["cases"].items()}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

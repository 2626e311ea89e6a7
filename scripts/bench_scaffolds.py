"""Side by side on the same tasks and policy: the project's own harness and an outside scaffold
driven through the endpoint (issue 52). Prints JSON: per agent, calls, tokens (trained, tree)
and reward per run, wall per run; for the scaffold the endpoint's own time per call (median,
mean) and its share of a call's time (endpoint + engine).

    .venv/bin/python scripts/bench_scaffolds.py [--runs 2] [--tasks examples/tasks/add-two]
        [--scaffold mini-swe-agent | --scaffold "python $PWD/tests/harness/scaffold_openai_client.py"]

(a scaffold's command starts in the run's workspace: give its script an absolute path).

In process, no fleet: TorchEngine over the tiny preset behind ``EngineCalls``, the endpoint on
the same loop (uvicorn), the real jail. The harness runs are the baseline, measured in the same
run. Durations are real (nothing paced).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.harness.chat_render import ChatRenderer
from gyre_hpc.harness.endpoint_server import EndpointServer
from gyre_hpc.harness.engine_client import EngineCalls
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.scaffold import ScaffoldRun, mini_swe_command
from gyre_hpc.harness.tasks.files import load_task, load_task_dir
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.models.tokenizer import embedded_tokenizer
from gyre_hpc.trees.builder import build_tree


def _tasks(path: str):
    p = Path(path)
    return [load_task(p)] if (p / "task.yaml").exists() else load_task_dir(p, field="--tasks")


def _row(results, trees) -> dict:
    return {"runs": len(results),
            "calls_per_run": float(np.mean([len(r.calls) for r in results])),
            "trained_tokens_per_run": float(np.mean([int(t.trained.sum()) for t in trees])),
            "tree_tokens_per_run": float(np.mean([t.n_tokens for t in trees])),
            "reward_mean": float(np.mean([r.reward for r in results])),
            "wall_s_per_run": float(np.mean([r.wall_s for r in results])),
            "statuses": sorted({r.status for r in results})}


async def bench(tasks, runs: int, scaffold: list[str], max_new_tokens: int, root: Path) -> dict:
    tok = embedded_tokenizer()
    calls = EngineCalls(TorchEngine(build_model("tiny", seed=1)), temperature=1.0)
    cfg = HarnessConfig(max_new_tokens=max_new_tokens, run_timeout_s=300.0)
    server = EndpointServer(ChatRenderer(tok), model_name="gyre-tiny", context_window=cfg.context_limit,
                            default_max_tokens=max_new_tokens, max_tokens_limit=max_new_tokens)
    server.start()
    out = {}
    try:
        for agent in ("harness", "scaffold"):
            results, trees, sessions = [], [], []
            for task in tasks:
                for g in range(runs):
                    rid = f"{agent}-{task.task_id}-{g}"
                    args = (task, root / rid, calls.client(g), root / f"{rid}.journal", cfg)
                    if agent == "harness":
                        run = AgentRun(*args, run_id=rid, tokenizer=tok)
                    else:
                        run = ScaffoldRun(*args, endpoint=server, command=scaffold, run_id=rid)
                    result = await run.run()
                    results.append(result)
                    trees.append(build_tree(result.calls, run_id=rid))
                    if agent == "scaffold":
                        sessions.append(run.session.stats)
            row = _row(results, trees)
            if sessions:
                over = np.concatenate([s.overhead_s for s in sessions]) * 1e3
                engine = np.concatenate([s.engine_s for s in sessions]) * 1e3
                journal = np.concatenate([s.journal_s for s in sessions]) * 1e3
                row.update(endpoint_overhead_ms_p50=float(np.median(over)), endpoint_overhead_ms_mean=float(over.mean()),
                           endpoint_journal_ms_p50=float(np.median(journal)),
                           endpoint_overhead_share=float(over.sum() / (over.sum() + engine.sum())),
                           drift=int(sum(s.drift for s in sessions)), branches=int(sum(s.branches for s in sessions)),
                           extends=int(sum(s.extends for s in sessions)))
            out[agent] = row
    finally:
        await server.stop()
    base = out["harness"]
    out["ratio_scaffold_over_harness"] = {k: (out["scaffold"][k] / base[k] if base[k] else None)
                                          for k in ("calls_per_run", "trained_tokens_per_run", "wall_s_per_run")}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per task and agent")
    parser.add_argument("--tasks", default="examples/tasks/add-two", help="a task folder or a task directory")
    parser.add_argument("--scaffold", default="mini-swe-agent", help="mini-swe-agent, or a command line")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    scaffold = mini_swe_command() if args.scaffold == "mini-swe-agent" else shlex.split(args.scaffold)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gyre-bench-scaffolds-") as tmp:
        out = asyncio.run(bench(_tasks(args.tasks), args.runs, scaffold, args.max_new_tokens, Path(tmp)))
    out.update(scaffold_command=args.scaffold, tasks=args.tasks, policy="tiny preset (random init, seed 1)",
               wall_s=time.perf_counter() - t0)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The rl workload with vLLM rollouts, and the main job's checkpoint served outside the project.

One ``gyre-hpc run examples/easy.yaml`` (local launcher, mpiexec) with ``rollout.engine=vllm``
and 2 steps; its last checkpoint must then load in transformers (model and tokenizer, from the
folder alone) and be served by vLLM with logprobs that match transformers' to 1e-3.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre_hpc.cells import checkpoint
from gyre_hpc.rundir.layout import RunDir
from gyre_hpc.rundir.metrics import read_table
from tests.rl.rl_helpers import REPO, mpi_env

pytestmark = [pytest.mark.mpi, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory) -> RunDir:
    run = RunDir.at(tmp_path_factory.mktemp("vllm-rl") / "run")
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    env = dict(mpi_env(), VLLM_LOGGING_LEVEL="WARNING")
    proc = subprocess.run([gyre, "run", "examples/easy.yaml", "--set", f"run_dir={run.root}",
                           "--set", "rollout.engine=vllm", "--set", "train.steps=2"],
                          capture_output=True, text=True, timeout=1200, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " step 2/2 reward " in proc.stdout     # the progress line (stdout is a pipe here)
    return run


def test_rl_run_with_vllm_rollouts_completes(vllm_run):
    steps = read_table(vllm_run.metrics, "steps")
    assert list(steps["step"]) == [1, 2]
    runs = read_table(vllm_run.metrics, "runs")
    assert len(runs["run_id"]) == 2 * 16 and set(runs["status"]) == {"finished"}
    assert checkpoint.read_meta(checkpoint.latest_dir(vllm_run.checkpoints)).step == 2


def test_vllm_rollouts_report_their_train_inference_gap(vllm_run):
    """vLLM's kernels are not the trainer's: the gap is measured each step, not assumed 0,
    and bounded (same weights, float32: rounding-sized differences, no clipping from them)."""
    steps = read_table(vllm_run.metrics, "steps")
    gap_max, gap_mean = steps["logprob_gap_max"], steps["logprob_gap_mean"]
    print("vllm rollouts: logprob gap max", gap_max.tolist(), "mean", gap_mean.tolist(),
          "pre-update clip share", steps["pre_update_clip_share"].tolist(), "KL", steps["behaviour_kl"].tolist())
    assert all(0.0 < g < 1e-2 for g in gap_max), gap_max
    assert all(0.0 < m <= g for m, g in zip(gap_mean, gap_max))
    assert all(c == 0.0 for c in steps["pre_update_clip_share"])
    assert all(0.0 <= k < 1e-4 for k in steps["behaviour_kl"])


def test_last_checkpoint_loads_in_transformers_and_vllm_serves_it_with_matching_logprobs(vllm_run):
    transformers = pytest.importorskip("transformers")
    from gyre_hpc.engines import Request, SamplingParams
    from gyre_hpc.engines.vllm_engine import VLLMEngine
    from gyre_hpc.harness.loop import SYSTEM_TEXT
    from gyre_hpc.harness.tokenizer import ChatFormat
    from gyre_hpc.models.tokenizer import load_tokenizer

    latest = checkpoint.latest_dir(vllm_run.checkpoints)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(latest), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(latest))
    chat = ChatFormat(load_tokenizer(latest))
    prompt = chat.message("system", SYSTEM_TEXT) + chat.message("user", "Answer with a digit.") + chat.generation_prompt()
    messages = [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": "Answer with a digit."}]
    rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered) == prompt

    engine = VLLMEngine(latest, name="serve", max_model_len=1024, kv_cache_memory_bytes=32 << 20)
    try:
        out = engine.generate(Request("p", tuple(prompt), SamplingParams(max_new_tokens=24, temperature=1.0, seed=5,
                                                                          stop_token_ids=())))
    finally:
        engine.close()
    ids = torch.tensor([prompt + list(out.token_ids)])
    with torch.no_grad():
        logp = torch.log_softmax(hf(input_ids=ids).logits[0].float(), -1)
    theirs = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert len(out.token_ids) == 24
    assert max(abs(a - b) for a, b in zip(out.logprobs, theirs)) < 1e-3

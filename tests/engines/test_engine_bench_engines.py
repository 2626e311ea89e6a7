"""`gyre-hpc bench engines`: TorchEngine, VLLMEngine and raw vLLM on the same model and prompts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
def test_bench_reports_rates_ratios_and_token_identity_for_every_case():
    # vLLM's default log level: with --json its INFO lines must go to stderr, not stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    proc = subprocess.run([gyre, "bench", "engines", "--json", "--preset", "tiny",
                           "--scale", "0.05", "--cases", "a_1x256+256,b_16x512+128,c_prefill_4k", "--repeats", "1"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)      # stdout is the JSON object and nothing else
    assert set(result["cases"]) == {"a_1x256+256", "b_16x512+128", "c_prefill_4k"}
    b = result["cases"]["b_16x512+128"]
    assert (b["streams"], b["prompt_tokens"], b["new_tokens"]) == (16, 25, 6)
    for case in result["cases"].values():
        rate = case["tokens_per_s"]
        assert all(rate[k] > 0 for k in ("torch", "torch_native", "vllm_engine", "vllm_raw"))
        assert case["invariant_cost"] == pytest.approx(rate["torch_native"] / rate["torch"], rel=1e-2)
        assert case["vllm_engine_over_raw"] == pytest.approx(rate["vllm_engine"] / rate["vllm_raw"], rel=1e-2)
        assert case["adapter_overhead"] == pytest.approx(1 - case["vllm_engine_over_raw"], abs=1e-3)
        # greedy on the same weights: the adapter and raw vLLM agree token for token
        assert case["tokens_identical"]["vllm_engine_vs_raw"]
    assert result["max_adapter_overhead"] == max(c["adapter_overhead"] for c in result["cases"].values())
    assert result["invariant_cost_batch"] == b["invariant_cost"]


def test_bench_refuses_an_unknown_case():
    from click.testing import CliRunner

    from gyre_hpc.bench.engines import command

    out = CliRunner().invoke(command, ["--cases", "a_1x256+256,z"])
    assert out.exit_code != 0 and "valid cases are a_1x256+256" in out.output

"""VLLMEngine runs the same conformance suite; it needs vLLM and a CUDA device, so it skips
here with that reason (see docs/engines.md for what is unverified)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[vllm] on a GPU node)")

from engine_conformance import EngineConformance  # noqa: E402

from gyre_hpc.engines.vllm_engine import VLLMEngine  # noqa: E402


@pytest.mark.gpu
class TestVLLMEngine(EngineConformance):
    carries_kv_cache = False
    logprob_atol = 2e-2   # GPU kernels (and bf16, if chosen) round differently from the float32 reference

    def make_engine(self, model_dir, name):
        return VLLMEngine(model_dir, name=name, dtype="float32", gpu_memory_utilization=0.1, enforce_eager=True)

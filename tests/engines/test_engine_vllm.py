"""VLLMEngine runs the same conformance suite as TorchEngine, here, on vLLM's CPU backend.

Skips (with the reason) only where vLLM is not installed and GYRE_REQUIRE_VLLM is unset;
``make test`` sets it, so CI cannot pass by skipping.
"""
from __future__ import annotations

import pytest

from engine_conformance import EngineConformance, greedy, run_all
from engine_helpers import prompt

from gyre_hpc.engines import Request

pytestmark = pytest.mark.vllm


class TestVLLMEngine(EngineConformance):
    carries_kv_cache = False
    # vLLM's CPU kernels round differently from the cache-free float32 reference (seen: 3e-6).
    logprob_atol = 1e-4

    def make_engine(self, model_dir, name):
        from gyre_hpc.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, name=name, max_model_len=2048, kv_cache_memory_bytes=32 << 20)

    @pytest.fixture
    def engine(self, model_dir):
        e = self.make_engine(model_dir, "a")
        yield e
        e.close()

    @pytest.fixture
    def engine_b(self, model_dir):
        e = self.make_engine(model_dir, "b")
        yield e
        e.close()

    def test_migrated_sequence_recomputes_only_what_the_prefix_cache_lacks(self, engine, engine_b):
        """The destination already served the same prompt: its prefix cache holds the prompt's
        full blocks, so the moved sequence recomputes only the tail, and says how much."""
        long_prompt = prompt(0) + tuple(7 + (i * 37) % 480 for i in range(300))
        engine_b.generate(Request("warm", long_prompt, greedy(4)))
        before = engine_b.counters()
        engine.submit(Request("m", long_prompt, greedy(20)))
        for _ in range(6):
            engine.step()
        state = engine.kv_export("m")
        engine_b.kv_import(state)
        out = run_all(engine_b)["m"]
        after = engine_b.counters()
        recomputed = after.recomputed_tokens - before.recomputed_tokens
        context = len(long_prompt) + len(state.token_ids)
        assert 0 < recomputed < context - 128, (recomputed, context)
        assert after.prefill_tokens - before.prefill_tokens == recomputed
        assert out.token_ids == engine.generate(Request("ref", long_prompt, greedy(20))).token_ids

    def test_load_weights_names_a_mismatched_tensor(self, engine):
        from gyre_hpc.models.checkpoint import read_state

        state = read_state(engine._model_dir)
        state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:, :3]
        with pytest.raises(ValueError, match=r"tensor model.layers.0.mlp.up_proj.weight has shape"):
            engine.load_weights(state, version=2)
        state["model.layers.9.bogus"] = state.pop("model.layers.0.mlp.up_proj.weight")
        with pytest.raises(ValueError, match=r"unexpected tensors \['model.layers.9.bogus'\]"):
            engine.load_weights(state, version=2)
        assert engine.policy_version == 0

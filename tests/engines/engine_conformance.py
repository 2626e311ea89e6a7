"""The behaviour every engine must show: subclass ``EngineConformance`` and define ``make_engine``.

The reference for tokens and logprobs is the model itself, run without any cache over the
whole sequence at every position (``full_recompute``): an engine's cache, batching and
migration are all invisible in its output, or it fails here.
"""
from __future__ import annotations

import pytest
import torch

from gyre_hpc.engines import Engine, EngineError, KVLayout, Request, SamplingParams
from gyre_hpc.engines.kv_state import KVState
from gyre_hpc.models.checkpoint import load_pretrained
from gyre_hpc.models.tiny_lm import VOCAB_SIZE

from engine_helpers import prompt


def greedy(n: int, stop=()) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=stop)


def sampled(n: int, seed: int, temperature: float = 1.0, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=())


@torch.no_grad()
def full_recompute(model, prompt_ids, output_ids) -> tuple[list[int], list[float]]:
    """Greedy choice and logprob of each given output token, from cache-free forwards."""
    ids = torch.tensor([list(prompt_ids) + list(output_ids)])
    logits = model(ids, torch.arange(ids.shape[1])[None])[0]
    start = len(prompt_ids) - 1
    rows = logits[start:start + len(output_ids)]
    logprobs = torch.log_softmax(rows.float(), dim=-1)
    return rows.argmax(-1).tolist(), [float(logprobs[i, t]) for i, t in enumerate(output_ids)]


def run_all(engine: Engine) -> dict:
    while engine.has_unfinished():
        engine.step()
    return {o.request_id: o for o in engine.pop_finished()}


def step_until(engine: Engine, request_id: str, n_tokens: int) -> None:
    """Step until ``request_id`` has produced ``n_tokens`` tokens."""
    seen = 0
    while seen < n_tokens:
        seen = max([seen] + [e.index + 1 for e in engine.step() if e.request_id == request_id])


class EngineConformance:
    logprob_atol = 1e-4
    # Capability: the engine hands out its KV cache (and sampler state) on export, so a
    # migrated sequence needs no prefill and a seeded one continues its own random stream.
    # An engine without it (vLLM) exports recompute states: greedy continuations still match.
    carries_kv_cache = True

    def make_engine(self, model_dir, name: str) -> Engine:
        raise NotImplementedError

    @pytest.fixture
    def engine(self, model_dir):
        return self.make_engine(model_dir, "a")

    @pytest.fixture
    def engine_b(self, model_dir):
        return self.make_engine(model_dir, "b")

    # -- decoding -------------------------------------------------------------------------
    def test_greedy_tokens_and_logprobs_match_full_recompute(self, engine, model_dir):
        out = engine.generate(Request("g", prompt(0), greedy(24)))
        assert len(out.token_ids) == 24 and out.finish_reason == "length"
        choice, logprobs = full_recompute(load_pretrained(model_dir), out.prompt_ids, out.token_ids)
        assert list(out.token_ids) == choice
        assert out.logprobs == pytest.approx(logprobs, abs=self.logprob_atol)
        assert len(set(out.token_ids)) > 3, "the test model should not repeat one token"

    def test_seeded_sampling_is_reproducible_and_independent_of_batch(self, engine, engine_b):
        alone = engine.generate(Request("s", prompt(1), sampled(24, seed=7)))
        for i in range(3):
            engine_b.submit(Request(f"other{i}", prompt(i + 2), sampled(30, seed=100 + i)))
        engine_b.step()
        engine_b.submit(Request("s", prompt(1), sampled(24, seed=7)))
        crowded = run_all(engine_b)["s"]
        assert crowded.token_ids == alone.token_ids
        assert crowded.logprobs == pytest.approx(alone.logprobs, abs=self.logprob_atol)
        other_seed = engine.generate(Request("s2", prompt(1), sampled(24, seed=8)))
        assert other_seed.token_ids != alone.token_ids

    def test_continuous_batching_matches_one_at_a_time(self, engine, engine_b):
        requests = [Request(f"r{i}", prompt(i), greedy(10 + 3 * i)) for i in range(5)]
        solo = {r.request_id: engine.generate(r) for r in requests}
        # Requests arrive while others decode and leave at different lengths.
        engine_b.submit(requests[0])
        engine_b.submit(requests[1])
        engine_b.step()
        engine_b.step()
        for r in requests[2:]:
            engine_b.submit(r)
            engine_b.step()
        batched = run_all(engine_b)
        for rid, out in solo.items():
            assert batched[rid].token_ids == out.token_ids, rid
            assert batched[rid].logprobs == pytest.approx(out.logprobs, abs=self.logprob_atol), rid
        assert engine_b.counters().prefill_tokens == sum(r.prompt_len for r in requests)

    def test_stop_token_ends_the_request_and_is_kept(self, engine):
        free = engine.generate(Request("free", prompt(3), greedy(20)))
        stop = free.token_ids[5]
        first = free.token_ids.index(stop)
        out = engine.generate(Request("stopped", prompt(3), greedy(20, stop=(stop,))))
        assert out.finish_reason == "stop"
        assert out.token_ids == free.token_ids[: first + 1]

    # -- migration ------------------------------------------------------------------------
    @pytest.mark.parametrize("params", [greedy(30), sampled(30, seed=11, temperature=0.8, top_p=0.9)],
                             ids=["greedy", "seeded"])
    def test_migrated_sequence_continues_exactly_without_prefill(self, engine, engine_b, params):
        if not self.carries_kv_cache and not params.greedy:
            pytest.skip(f"{type(self).__name__}: no exportable sampler state, a moved sampled request restarts its stream")
        reference = engine.generate(Request("ref", prompt(4), params))
        engine.submit(Request("m", prompt(4), params))
        step_until(engine, "m", 9)
        state = engine.kv_export("m")
        assert len(state.token_ids) == 9 and state.remaining_tokens == 21
        assert state.cached_len == (len(prompt(4)) + 8 if self.carries_kv_cache else 0)
        assert "m" not in engine.request_ids()
        before = engine_b.counters()
        engine_b.kv_import(state)
        out = run_all(engine_b)["m"]
        after = engine_b.counters()
        assert out.token_ids == reference.token_ids
        assert out.logprobs == pytest.approx(reference.logprobs, abs=self.logprob_atol)
        assert out.migrations == 1
        if self.carries_kv_cache:
            assert after.prefill_tokens == before.prefill_tokens, "the destination must not re-prefill"
            assert after.decode_tokens - before.decode_tokens == 21
        assert after.migrations_in == 1 and engine.counters().migrations_out == 1

    def test_request_exported_before_prefill_is_prefilled_at_destination(self, engine, engine_b):
        engine.submit(Request("q", prompt(2), greedy(8)))
        state = engine.kv_export("q")
        assert not state.prefilled and state.token_ids == ()
        engine_b.kv_import(state)
        out = run_all(engine_b)["q"]
        assert out.token_ids == engine.generate(Request("q2", prompt(2), greedy(8))).token_ids
        assert engine_b.counters().prefill_tokens == len(prompt(2))

    def test_drain_stops_admission_and_exports_every_inflight_sequence(self, engine):
        for i in range(3):
            engine.submit(Request(f"d{i}", prompt(i), greedy(20)))
        engine.step()
        engine.submit(Request("d3", prompt(3), greedy(20)))   # queued, not prefilled
        states = engine.drain()
        assert sorted(s.request_id for s in states) == ["d0", "d1", "d2", "d3"]
        ordered = sorted(states, key=lambda s: s.request_id)
        assert [bool(s.token_ids) for s in ordered] == [True, True, True, False]
        # Only an engine that hands out its cache exports prefilled states; others export recompute states.
        assert [s.prefilled for s in ordered] == [self.carries_kv_cache] * 3 + [False]
        assert engine.request_ids() == [] and not engine.has_unfinished()
        with pytest.raises(EngineError, match="draining"):
            engine.submit(Request("late", prompt(0), greedy(4)))
        engine.open()
        assert engine.generate(Request("late", prompt(0), greedy(4))).finish_reason == "length"

    def test_export_unknown_or_finished_request_says_which(self, engine):
        engine.generate(Request("done", prompt(0), greedy(3)))
        with pytest.raises(KeyError, match="nope.*not in this engine"):
            engine.kv_export("nope")

    def test_import_rejects_a_foreign_layout_naming_the_field(self, engine, engine_b):
        engine.submit(Request("x", prompt(0), greedy(10)))
        engine.step()
        state = engine.kv_export("x")
        lay = state.layout
        foreign = KVState(**{**state.__dict__, "layout": KVLayout(lay.n_layers, lay.n_heads, lay.head_dim, "float64")})
        with pytest.raises(ValueError, match="dtype=float64"):
            engine_b.kv_import(foreign)
        assert engine_b.request_ids() == []

    # -- requests ---------------------------------------------------------------------------
    def test_submit_rejects_duplicates_and_out_of_vocab_ids(self, engine):
        engine.submit(Request("dup", prompt(0), greedy(4)))
        with pytest.raises(ValueError, match="dup"):
            engine.submit(Request("dup", prompt(1), greedy(4)))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.submit(Request("bad", (1, VOCAB_SIZE + 5), greedy(4)))

    # -- weights and memory ---------------------------------------------------------------
    def test_load_weights_changes_the_policy_and_its_version(self, engine, other_model_dir):
        before = engine.generate(Request("w0", prompt(5), greedy(16)))
        other = load_pretrained(other_model_dir)
        engine.load_weights(other.state_dict(), version=3)
        after = engine.generate(Request("w1", prompt(5), greedy(16)))
        assert engine.policy_version == 3 and after.policy_version == 3 and before.policy_version == 0
        assert after.token_ids != before.token_ids
        assert list(after.token_ids) == full_recompute(other, after.prompt_ids, after.token_ids)[0]
        with pytest.raises(ValueError, match="missing tensors"):
            engine.load_weights({}, version=4)
        assert engine.policy_version == 3

    def test_sleep_refuses_inflight_then_level2_needs_weights(self, engine, model_dir):
        engine.submit(Request("z", prompt(0), greedy(4)))
        with pytest.raises(EngineError, match="drain"):
            engine.sleep()
        engine.drain()
        engine.sleep(level=2)
        with pytest.raises(EngineError, match="asleep"):
            engine.step()
        engine.wake()
        with pytest.raises(EngineError, match="load_weights"):
            engine.open()
        engine.load_weights(load_pretrained(model_dir).state_dict(), version=1)
        engine.open()
        out = engine.generate(Request("z2", prompt(0), greedy(12)))
        assert list(out.token_ids) == full_recompute(load_pretrained(model_dir), out.prompt_ids, out.token_ids)[0]

"""TorchEngine: the conformance suite plus what only the reference engine promises."""
from __future__ import annotations

import pytest
import torch

from gyre_hpc.engines import Request
from gyre_hpc.engines.kv_state import KVState, from_wire, to_wire
from gyre_hpc.engines.sampling import sample_token
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.models.checkpoint import load_pretrained

from engine_conformance import EngineConformance, full_recompute, greedy, run_all, sampled, step_until
from engine_helpers import prompt


class TestTorchEngine(EngineConformance):
    logprob_atol = 1e-5

    def make_engine(self, model_dir, name):
        return TorchEngine.from_pretrained(model_dir, name=name, max_batch=8)


@pytest.fixture
def engines(model_dir):
    return (TorchEngine.from_pretrained(model_dir, name="a"), TorchEngine.from_pretrained(model_dir, name="b"))


def test_corrupted_cache_changes_the_continuation(engines):
    """Negative control: the migration test compares tokens, so it must notice a wrong cache."""
    a, b = engines
    reference = a.generate(Request("ref", prompt(4), greedy(30)))
    a.submit(Request("m", prompt(4), greedy(30)))
    step_until(a, "m", 5)
    state = a.kv_export("m")
    k0, v0 = state.kv[0]
    broken = KVState(**{**state.__dict__, "kv": ((torch.zeros_like(k0), v0),) + state.kv[1:]})
    b.kv_import(broken)
    assert run_all(b)["m"].token_ids != reference.token_ids


def test_sampled_tokens_follow_the_reference_sampler(engines, model_dir):
    a, _ = engines
    params = sampled(20, seed=5, temperature=0.7, top_p=0.8)
    out = a.generate(Request("s", prompt(2), params))
    model = load_pretrained(model_dir)
    gen = torch.Generator().manual_seed(5)
    ids = list(prompt(2))
    with torch.no_grad():
        for _ in range(20):
            # the engine's invariant numerics: the same logits bit for bit, so no draw can
            # land between two roundings of a CDF boundary
            logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], invariant=True)[0, -1]
            ids.append(sample_token(logits, params, gen)[0])
    assert list(out.token_ids) == ids[len(prompt(2)):]


def test_chunked_prefill_matches_one_shot_prefill(model_dir):
    one = TorchEngine.from_pretrained(model_dir, prefill_chunk=4096)
    chunked = TorchEngine.from_pretrained(model_dir, prefill_chunk=5)
    long_prompt = prompt(9, length=60)
    a = one.generate(Request("p", long_prompt, greedy(12)))
    b = chunked.generate(Request("p", long_prompt, greedy(12)))
    assert a.token_ids == b.token_ids
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert chunked.counters().prefill_tokens == len(long_prompt)
    one.submit(Request("k", long_prompt, greedy(4)))
    chunked.submit(Request("k", long_prompt, greedy(4)))
    one.step()
    chunked.step()
    for (ka, va), (kb, vb) in zip(one.kv_export("k").kv, chunked.kv_export("k").kv):
        torch.testing.assert_close(kb, ka, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb, va, atol=1e-5, rtol=1e-5)


def test_max_batch_bounds_the_running_batch_and_load_counts_outstanding_tokens(model_dir):
    e = TorchEngine.from_pretrained(model_dir, max_batch=2)
    reqs = [Request(f"r{i}", prompt(i), greedy(10)) for i in range(4)]
    for r in reqs:
        e.submit(r)
    assert e.load().outstanding_tokens == sum(r.prompt_len + 10 for r in reqs)
    e.step()
    load = e.load()
    assert (load.running, load.queued) == (2, 2)
    assert load.kv_tokens == reqs[0].prompt_len + reqs[1].prompt_len
    assert load.outstanding_tokens == 2 * 9 + reqs[2].prompt_len + reqs[3].prompt_len + 20
    assert len(run_all(e)) == 4


def test_a_full_engine_queues_a_moved_sequence_with_its_kv_instead_of_failing(model_dir):
    """A released engine's sequences moving to an engine whose slots are all taken (an async
    split of one engine took them all at start: SlotKVCache ran out of rows and the rank
    died). The moved one waits for a slot, then continues exactly, with no prefill."""
    src, dst = TorchEngine.from_pretrained(model_dir, name="src"), TorchEngine.from_pretrained(model_dir, max_batch=2)
    reference = src.generate(Request("ref", prompt(5), greedy(12)))
    for i in range(2):
        dst.submit(Request(f"busy{i}", prompt(i), greedy(6)))
    dst.step()
    src.submit(Request("moved", prompt(5), greedy(12)))
    step_until(src, "moved", 4)
    state = src.kv_export("moved")
    assert state.prefilled
    prefilled = dst.counters().prefill_tokens
    dst.kv_import(state)
    assert (dst.load().running, dst.load().queued) == (2, 1)
    out = run_all(dst)
    assert out["moved"].token_ids == reference.token_ids
    assert dst.counters().prefill_tokens == prefilled        # the queued KV was written, not recomputed


def test_an_engine_wider_than_32_holds_all_its_sequences(model_dir):
    e = TorchEngine.from_pretrained(model_dir, max_batch=40)
    for i in range(40):
        e.submit(Request(f"w{i}", prompt(i % 5), greedy(3)))
    e.step()
    assert e.load().running == 40
    assert len(run_all(e)) == 40


def test_an_unpaced_engine_keeps_no_record_per_model_call(model_dir):
    """The per-step prefill record (the pace's input) is reset every step, paced or not: an
    engine serving a long job must not hold one entry per call it ever prefilled
    (``bench load`` found 456 entries per engine after 768 calls)."""
    e = TorchEngine.from_pretrained(model_dir)
    for i in range(50):
        e.submit(Request(f"c{i}", prompt(i % 5), greedy(2)))
        run_all(e)
    assert e.counters().requests_finished == 50
    assert len(e._step_prefills) <= 1


def test_request_beyond_max_position_is_refused_naming_the_fields(model_dir):
    e = TorchEngine.from_pretrained(model_dir)
    limit = e.model.config.max_position
    with pytest.raises(ValueError, match="max_new_tokens.*max_position"):
        e.submit(Request("long", prompt(0), greedy(limit)))


def test_greedy_logprobs_are_untempered_model_logprobs(engines, model_dir):
    """Sampling at temperature 0.5 still reports log_softmax of the raw logits."""
    a, _ = engines
    out = a.generate(Request("t", prompt(1), sampled(10, seed=3, temperature=0.5)))
    _, logprobs = full_recompute(load_pretrained(model_dir), out.prompt_ids, out.token_ids)
    assert out.logprobs == pytest.approx(logprobs, abs=1e-5)


def test_recompute_state_continues_exactly_after_a_prefill_of_its_context(engines):
    """A state without a cache (what vLLM exports) re-prefills prompt + tokens[:-1], then continues."""
    a, b = engines
    reference = a.generate(Request("ref", prompt(3), sampled(25, seed=9)))
    a.submit(Request("r", prompt(3), sampled(25, seed=9)))
    step_until(a, "r", 7)
    state = a.kv_export("r")
    b.kv_import(KVState(**{**state.__dict__, "kv": ()}))
    out = run_all(b)["r"]
    assert out.token_ids == reference.token_ids
    assert out.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert b.counters().prefill_tokens == len(prompt(3)) + 6


def test_a_prefill_budget_keeps_the_batch_decoding_while_a_long_prompt_fills(model_dir):
    """vLLM-style token budget: an 88-token prompt under max_prefill_tokens=16 fills over six
    steps while the running sequence gets a token every step; outputs equal the unbudgeted run."""
    free = TorchEngine.from_pretrained(model_dir)
    budgeted = TorchEngine.from_pretrained(model_dir, max_prefill_tokens=16, prefill_chunk=5)
    short, long = Request("short", prompt(1), greedy(12)), Request("long", prompt(9, length=60), greedy(6))
    want = {r.request_id: free.generate(r) for r in (short, long)}
    budgeted.submit(short)
    budgeted.step()
    budgeted.submit(long)
    assert long.prompt_len == 88
    firsts = []
    for _ in range(6):
        events = budgeted.step()
        assert "short" in {e.request_id for e in events}
        firsts.append(any(e.request_id == "long" for e in events))
        assert budgeted.load().queued == (0 if firsts[-1] else 1)
    assert firsts == [False] * 5 + [True]          # ceil(88 / 16) = 6 steps
    outputs = run_all(budgeted)
    for rid, out in want.items():
        assert outputs[rid].token_ids == out.token_ids, rid
        assert outputs[rid].logprobs == pytest.approx(out.logprobs, abs=1e-5), rid
    assert budgeted.counters().prefill_tokens == short.prompt_len + long.prompt_len


def test_a_sequence_exported_mid_prefill_carries_its_partial_kv_and_finishes_exactly(model_dir):
    """Exported in the middle of a budgeted prefill, the sequence carries the KV of what is
    filled; the destination fills only the rest (no prompt token prefilled twice) and the
    output equals an unmoved run's."""
    a = TorchEngine.from_pretrained(model_dir, name="a", max_prefill_tokens=16)
    b = TorchEngine.from_pretrained(model_dir, name="b")
    req = Request("p", prompt(9, length=60), greedy(8))
    a.submit(req)
    a.step()
    a.step()
    assert a.request_ids() == ["p"] and a.load().queued == 1 and a.counters().prefill_tokens == 32
    state = a.kv_export("p")
    assert state.partial and state.cached_len == 32 and state.token_ids == () and a.request_ids() == []
    wire = from_wire(*to_wire(state))        # the MPI path's form
    assert wire.partial and wire.cached_len == 32
    b.kv_import(wire)
    reference = TorchEngine.from_pretrained(model_dir).generate(req)
    out = run_all(b)["p"]
    assert out.token_ids == reference.token_ids
    assert out.logprobs == pytest.approx(reference.logprobs, abs=1e-5)
    assert a.counters().prefill_tokens + b.counters().prefill_tokens == req.prompt_len


def test_a_partial_state_with_kv_of_the_wrong_shape_is_refused(model_dir):
    a = TorchEngine.from_pretrained(model_dir, name="a", max_prefill_tokens=16)
    a.submit(Request("p", prompt(9, length=60), greedy(8)))
    a.step()
    state = a.kv_export("p")
    bad = KVState(**{**state.__dict__, "kv": tuple((k[:, :, :1], v) for k, v in state.kv)})
    with pytest.raises(ValueError, match=r"kv\[0\]\.k has shape"):
        bad.check()


def test_a_bad_prefill_budget_is_named(model_dir):
    with pytest.raises(ValueError, match="max_prefill_tokens=0"):
        TorchEngine.from_pretrained(model_dir, max_prefill_tokens=0)

"""TorchEngine's invariant mode: one logprob per token, bit for bit, however it was computed.

The same request (same prompt, same seed) is decoded alone, in a batch of 16 mixed requests,
after its session's retained context, after a KV migration to another engine mid-decode,
and with another prefill chunking; every token and every float32 logprob must be equal
(``==``, not approx). The native mode is the negative control: the same comparisons find
a difference there on this kind of machine, so the test is not passing by accident of tiny
numbers.
"""
from __future__ import annotations

import torch

from gyre_hpc.engines import Request
from gyre_hpc.engines.torch_engine import TorchEngine

from engine_conformance import run_all, sampled, step_until
from engine_helpers import prompt

PARAMS = sampled(24, seed=11, temperature=1.0)


def _engine(model_dir, name="e", invariant=True, **kw):
    return TorchEngine.from_pretrained(model_dir, name=name, max_batch=32, invariant=invariant, **kw)


def _alone(model_dir, invariant=True, **kw):
    return _engine(model_dir, invariant=invariant, **kw).generate(Request("x", prompt(5, length=40), PARAMS))


def _variants(model_dir, invariant: bool) -> dict:
    """The target request's output under each way of computing it."""
    target = Request("x", prompt(5, length=40), PARAMS)
    out = {"alone": _alone(model_dir, invariant)}

    eng = _engine(model_dir, invariant=invariant)
    for i in range(15):   # mixed: other prompts and lengths, greedy and sampled, started before it
        params = sampled(8 + 3 * i, seed=i) if i % 2 else sampled(8 + 3 * i, seed=i, temperature=0.0)
        eng.submit(Request(f"o{i}", prompt(i, length=5 + 7 * i), params))
        if i == 7:
            eng.step()
    eng.submit(target)
    out["batch16"] = run_all(eng)["x"]

    # Retained context: the session's first call ends mid-prompt of the second; the second
    # call's prompt is the target's, of which it prefills only the new tokens.
    eng = _engine(model_dir, invariant=invariant)
    head = target.prompt_ids[:23]
    first = eng.generate(Request("s1", head, sampled(1, seed=3, temperature=0.0), session="sess"))
    assert first.token_ids   # its context head + output[:-1] == head is retained
    out["retained"] = eng.generate(Request("x", target.prompt_ids, PARAMS, session="sess"))
    assert eng.counters().cached_prompt_tokens == len(head)

    # Migration mid-decode: 9 tokens here, the rest on another engine from the moved KV.
    src, dst = _engine(model_dir, "src", invariant), _engine(model_dir, "dst", invariant)
    for i in range(3):
        src.submit(Request(f"m{i}", prompt(i + 20, length=30), sampled(30, seed=i)))
    src.submit(target)
    step_until(src, "x", 9)
    dst.submit(Request("busy", prompt(30, length=50), sampled(40, seed=1)))
    dst.step()
    dst.kv_import(src.kv_export("x"))
    out["migrated"] = run_all(dst)["x"]

    out["chunked"] = _alone(model_dir, invariant, prefill_chunk=7)
    out["budgeted"] = _alone(model_dir, invariant, max_prefill_tokens=13)
    return out


def test_invariant_logprobs_are_bitwise_equal_alone_batched_retained_migrated_and_chunked(model_dir):
    out = _variants(model_dir, invariant=True)
    ref = out["alone"]
    assert len(ref.token_ids) == PARAMS.max_new_tokens or ref.finish_reason == "stop"
    for name, o in out.items():
        assert o.token_ids == ref.token_ids, name
        assert o.logprobs == ref.logprobs, (name, [a - b for a, b in zip(o.logprobs, ref.logprobs)])


def test_native_mode_is_the_negative_control(model_dir):
    """Without the invariant kernels at least one way of computing differs in the last bits
    (the gap the invariant mode closes), yet stays within the native tolerance."""
    out = _variants(model_dir, invariant=False)
    ref = out["alone"]
    gaps = {name: max(abs(a - b) for a, b in zip(o.logprobs, ref.logprobs))
            for name, o in out.items() if o.token_ids == ref.token_ids}
    assert max(gaps.values()) < 1e-4
    assert any(g > 0 for g in gaps.values()), gaps


def test_invariant_logprobs_equal_a_plain_forward_over_the_context(model_dir):
    """The engine's logprob of each token is the model's invariant full-context forward's, bit
    for bit: what the trainer computes (the tree tests check the packed tree side)."""
    out = _alone(model_dir)
    eng = _engine(model_dir)
    ids = list(prompt(5, length=40)) + list(out.token_ids)
    with torch.no_grad():
        logits = eng.model(torch.tensor([ids]), torch.arange(len(ids))[None], invariant=True)[0]
    logp = torch.log_softmax(logits.float(), -1)
    n = len(prompt(5, length=40))
    expected = [float(logp[n - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert list(out.logprobs) == expected

"""The seeded sampler and the KVState wire form: pure functions, no engine needed."""
from __future__ import annotations

import pytest
import torch

from gyre_hpc.engines import KVLayout, KVState, Request, SamplingParams
from gyre_hpc.engines.kv_state import alloc_wire, from_wire, generator_from_state, generator_state, to_wire
from gyre_hpc.engines.sampling import sample_token, sampling_probs

LOGITS = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_greedy_picks_argmax_and_reports_untempered_logprob():
    token, logprob = sample_token(LOGITS, SamplingParams(temperature=0), None)
    assert token == 0 and logprob == pytest.approx(torch.log(torch.tensor(0.5)).item(), abs=1e-6)


def test_top_p_keeps_only_the_nucleus_and_frequencies_follow_it():
    params = SamplingParams(temperature=1.0, top_p=0.7)
    assert sampling_probs(LOGITS, params).tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    gen = torch.Generator().manual_seed(0)
    draws = [sample_token(LOGITS, params, gen)[0] for _ in range(2000)]
    assert set(draws) == {0, 1}
    assert draws.count(0) / 2000 == pytest.approx(0.625, abs=0.03)


def test_temperature_sharpens_the_distribution():
    cold = sampling_probs(LOGITS, SamplingParams(temperature=0.5))
    assert cold[0] > 0.5 and cold.sum().item() == pytest.approx(1.0)


def test_each_token_consumes_exactly_one_draw():
    """What makes the generator state small and portable: one float64 draw per token."""
    gen = torch.Generator().manual_seed(42)
    sample_token(LOGITS, SamplingParams(temperature=1.0), gen)
    twin = torch.Generator().manual_seed(42)
    torch.rand((), generator=twin, dtype=torch.float64)
    assert torch.rand(3, generator=gen).tolist() == torch.rand(3, generator=twin).tolist()


def test_sampler_rejects_batches_and_missing_generator():
    with pytest.raises(ValueError, match="one \\[V\\] row"):
        sample_token(LOGITS[None], SamplingParams(temperature=0), None)
    with pytest.raises(ValueError, match="generator"):
        sample_token(LOGITS, SamplingParams(temperature=1.0), None)


def test_bad_sampling_params_name_the_field():
    for kwargs, field in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0.0}, "top_p")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        Request("r", ())


def _state(dtype=torch.float32, generated=3) -> KVState:
    req = Request("w", (257, 1, 2, 3, 4), SamplingParams(max_new_tokens=8, temperature=0.9, seed=3, stop_token_ids=(7,)))
    lay = KVLayout(n_layers=2, n_heads=4, head_dim=8, dtype=str(dtype).removeprefix("torch."))
    n = req.prompt_len + generated - 1
    g = torch.Generator().manual_seed(1)
    kv = tuple((torch.randn(n, 4, 8, generator=g).to(dtype), torch.randn(n, 4, 8, generator=g).to(dtype))
               for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    torch.rand(generated, generator=gen)
    return KVState(req, lay, tuple(range(10, 10 + generated)), tuple(-0.5 * i for i in range(generated)), kv,
                   seed=3, rng_state=generator_state(gen), policy_version=4, migrations=1, source="e0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_round_trip_keeps_every_field_and_byte(dtype):
    state = _state(dtype)
    state.check()
    header, tensors = to_wire(state)
    received = alloc_wire(header)
    for dst, src in zip(received, tensors):
        dst.view(torch.uint8).copy_(src.view(torch.uint8))   # what the MPI byte chunks do
    back = from_wire(header, received)
    assert back.request == state.request and back.token_ids == state.token_ids and back.logprobs == state.logprobs
    assert (back.seed, back.policy_version, back.migrations, back.layout) == (3, 4, 1, state.layout)
    for (ka, va), (kb, vb) in zip(state.kv, back.kv):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(generator_from_state(back.rng_state).get_state(), generator_from_state(state.rng_state).get_state())
    assert state.nbytes == state.layout.bytes_per_token * state.cached_len


def test_check_names_what_is_wrong():
    state = _state()
    with pytest.raises(ValueError, match="2 logprobs for 3 token_ids"):
        KVState(**{**state.__dict__, "logprobs": state.logprobs[:2]}).check()
    with pytest.raises(ValueError, match=r"kv\[1\].v has shape"):
        kv = list(state.kv)
        kv[1] = (kv[1][0], kv[1][1][:-1])
        KVState(**{**state.__dict__, "kv": tuple(kv)}).check()
    KVState(**{**state.__dict__, "kv": ()}).check()   # a recompute state is valid
    with pytest.raises(ValueError, match="but no token_ids"):
        KVState(**{**state.__dict__, "token_ids": (), "logprobs": ()}).check()
    with pytest.raises(ValueError, match="more than max_new_tokens"):
        KVState(**{**state.__dict__, "token_ids": tuple(range(9)), "logprobs": (0.0,) * 9}).check()

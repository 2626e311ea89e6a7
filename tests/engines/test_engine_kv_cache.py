"""SlotKVCache: the model hook's attention equals plain attention over the whole sequence
(grouped-query heads included), rows survive compaction and growth, and decoding writes
into the same storage step after step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gyre_hpc.engines import Request
from gyre_hpc.engines.kv_cache import SlotKVCache
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.models.tiny_lm import build_model

from engine_conformance import greedy
from engine_helpers import prompt

HQ, HKV, DH, LAYERS = 4, 2, 8, 2


def _qkv(gen, T, hq=HQ, hkv=HKV):
    return (torch.randn(1, hq, T, DH, generator=gen, dtype=torch.float64),
            torch.randn(1, hkv, T, DH, generator=gen, dtype=torch.float64),
            torch.randn(1, hkv, T, DH, generator=gen, dtype=torch.float64))


def _reference(q, k, v):
    """Causal attention over the whole sequence with kv heads repeated HF-style (repeat_kv)."""
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)


def _cache(**kw):
    return SlotKVCache(LAYERS, HKV, DH, torch.float64, **kw)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("chunk", [3, 7, 40])
def test_chunked_prefill_then_batched_decode_equals_full_attention_with_gqa(chunk, invariant):
    gen = torch.Generator().manual_seed(0)
    lengths = [11, 5, 17]                      # prompts of different lengths share a decode batch
    steps = 4
    seqs = [_qkv(gen, n + steps) for n in lengths]
    cache = _cache(invariant=invariant)
    for (q, k, v), n in zip(seqs, lengths):
        row = cache.add_row(n)
        for start in range(0, n, chunk):
            t = min(chunk, n - start)
            hook = cache.prefill(row, t)
            for layer in range(LAYERS):
                out = hook.attend(layer, q[:, :, start:start + t], k[:, :, start:start + t], v[:, :, start:start + t])
                want = _reference(q[:, :, :start + t], k[:, :, :start + t], v[:, :, :start + t])[:, :, start:]
                torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
            hook.commit()
    assert cache.lengths == lengths
    for s in range(steps):
        hook = cache.decode()
        at = [n + s for n in lengths]
        q = torch.cat([sq[:, :, i:i + 1] for (sq, _, _), i in zip(seqs, at)])
        k = torch.cat([sk[:, :, i:i + 1] for (_, sk, _), i in zip(seqs, at)])
        v = torch.cat([sv[:, :, i:i + 1] for (_, _, sv), i in zip(seqs, at)])
        for layer in range(LAYERS):
            out = hook.attend(layer, q, k, v)
            for b, ((sq, sk, sv), i) in enumerate(zip(seqs, at)):
                want = _reference(sq[:, :, :i + 1], sk[:, :, :i + 1], sv[:, :, :i + 1])[:, :, i:]
                torch.testing.assert_close(out[b:b + 1], want, rtol=1e-10, atol=1e-10)
        hook.commit()
    assert cache.lengths == [n + steps for n in lengths]


def _filled(cache, n, value):
    row = cache.add_row(n)
    kv = [(torch.full((n, HKV, DH), value + layer, dtype=torch.float64),
           torch.full((n, HKV, DH), -value - layer, dtype=torch.float64)) for layer in range(LAYERS)]
    cache.write(row, kv)
    return row


@pytest.mark.parametrize("invariant", [False, True])
def test_removing_a_row_moves_the_last_row_into_it_and_an_empty_cache_frees_its_buffers(invariant):
    cache = _cache(invariant=invariant)
    for i, n in enumerate((4, 9, 6)):
        _filled(cache, n, 10.0 * i)
    assert cache.remove_row(0) == 2          # row 2 now lives in row 0
    assert cache.lengths == [6, 9]
    k, v = cache.read(0)[1]
    assert k.shape == (6, HKV, DH) and bool((k == 21.0).all()) and bool((v == -21.0).all())
    assert bool((cache.read(1)[0][0] == 10.0).all())
    assert cache.remove_row(1) is None and cache.lengths == [6]
    cache.remove_row(0)
    assert cache.k == [] and cache.capacity == 0
    with pytest.raises(IndexError, match="rows are 0..-1"):
        cache.remove_row(0)


@pytest.mark.parametrize("invariant", [False, True])
def test_growth_in_rows_and_tokens_keeps_every_row(invariant):
    cache = _cache(max_tokens=1000, invariant=invariant)
    rows = [_filled(cache, 3 + i, float(i)) for i in range(5)]       # rows 1 -> 2 -> 4 -> 8
    cache.reserve(700)                                   # tokens 256 -> 700, rounded up to the key block
    assert cache.allocated_rows == 8 and cache.capacity == 704
    for i in rows:
        assert bool((cache.read(i)[1][0] == i + 1.0).all()) and cache.lengths[i] == 3 + i
    cache.reserve(800)
    assert cache.capacity == 1000                                      # doubling stops at max_tokens
    with pytest.raises(ValueError, match="max_tokens=1000"):
        cache.reserve(1001)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("kv_heads", [HKV, 1])
def test_read_is_a_copy_the_reused_row_cannot_change(kv_heads, invariant):
    """One kv head is the trap: a transposed [1, n, Dh] row already counts as contiguous."""
    cache = SlotKVCache(LAYERS, kv_heads, DH, torch.float64, invariant=invariant)
    for value in (1.0, 7.0):
        row = cache.add_row(5)
        cache.write(row, [(torch.full((5, kv_heads, DH), value), torch.full((5, kv_heads, DH), -value))] * LAYERS)
    kept = cache.read(0)
    cache.remove_row(0)                       # row 1 moves into row 0
    assert bool((kept[0][0] == 1.0).all()) and bool((kept[1][1] == -1.0).all())


def test_decode_writes_into_the_same_storage_every_step():
    """No per-step copy of the cache: within its capacity the engine's buffers never move."""
    e = TorchEngine(build_model("tiny", seed=0), max_batch=4)
    for i in range(3):
        e.submit(Request(f"r{i}", prompt(i), greedy(30)))
    e.step()
    e.step()
    ptrs = [t.data_ptr() for t in e._cache.k + e._cache.v]
    before = list(e._cache.lengths)
    for _ in range(10):
        e.step()
    assert [t.data_ptr() for t in e._cache.k + e._cache.v] == ptrs
    assert e._cache.lengths == [n + 10 for n in before]


def test_an_invariant_cache_keeps_keys_as_k_transposed_for_the_bag_sums():
    """The invariant kernels read a row's K^T as rows of length capacity: stored so, a decode
    step reads the cache where it lies; ``k[layer]`` is still the [rows, Hkv, capacity, Dh] view."""
    cache = _cache(invariant=True)
    _filled(cache, 5, 3.0)
    k, v = cache.k[0], cache.v[0]
    assert k.shape == v.shape == (1, HKV, cache.capacity, DH)
    assert k.transpose(-1, -2).is_contiguous() and v.is_contiguous()
    assert bool((k[0, :, :5] == 3.0).all()) and bool((k[0, :, 5:] == 0.0).all())
    assert _cache().k == [] and SlotKVCache(LAYERS, HKV, DH, torch.float64).invariant is False


def test_the_model_refuses_a_mask_or_past_next_to_its_kv_cache():
    model = build_model("tiny", seed=0)
    cache = SlotKVCache(2, 4, 16, torch.float32)
    hook = cache.prefill(cache.add_row(4), 4)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="kv_cache"):
        model(ids, torch.arange(4)[None], attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), kv_cache=hook)


def test_cache_heads_reads_both_config_generations():
    from types import SimpleNamespace

    from gyre_hpc.engines.torch_engine import cache_heads

    assert cache_heads(SimpleNamespace(n_heads=4, head_dim=16)) == (4, 16)   # the byte-level TinyLM's names
    qwen_style = SimpleNamespace(n_heads=4, kv_heads=2, n_kv_heads=2, head_dim=None, dh=32)
    assert cache_heads(qwen_style) == (2, 32)


def test_bfloat16_chunked_prefill_keeps_the_dtype_and_tracks_one_shot():
    model = build_model("tiny", seed=0).to(torch.bfloat16)
    long_prompt = prompt(9, length=60)
    one = TorchEngine(model, prefill_chunk=4096).generate(Request("p", long_prompt, greedy(6)))
    chunked = TorchEngine(model, prefill_chunk=16).generate(Request("p", long_prompt, greedy(6)))
    assert chunked.logprobs == pytest.approx(one.logprobs, abs=0.05)

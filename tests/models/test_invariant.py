"""models.invariant: the kernels are right (close to the library's) and invariant (equal bits).

The invariance tests are also the check of the kernel property the products rest on (a bag
sum is one fused multiply-add after another in the bag's order), on the machine the suite runs
on: a machine where it fails fails here, by name.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gyre_hpc.models import invariant as inv
from gyre_hpc.models.decoder import build_model


@pytest.mark.parametrize("shape", [(64, 172), (172, 64), (128, 344), (344, 128), (128, 512), (32, 64), (5, 3)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_is_the_same_whatever_rows_are_beside_it(shape, threads):
    k, n = shape
    g = torch.Generator().manual_seed(k * n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(300, k, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([inv.linear(x[i:i + 1], w, b) for i in range(24)])
        for m in (2, 3, 4, 5, 7, 8, 9, 11, 16, 17, 33, 300):
            assert torch.equal(inv.linear(x[:m], w, b)[:24], alone[:min(m, 24)]), m
        shifted = inv.linear(torch.cat([torch.randn(5, k, generator=g), x[:40]]), w, b)[5:]
        assert torch.equal(shifted[:24], alone)
        assert torch.equal(inv.linear(x[:40].view(4, 10, k), w, b).view(40, n)[:24], alone)
    finally:
        torch.set_num_threads(before)
    assert torch.allclose(inv.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def _fma_chain(row, weight):
    """Each output feature as fl32(acc + x_k * w_k) for k in order, from 0: a product of two
    float32 is exact in float64, so this is one fused multiply-add after another (up to
    double rounding, which these seeded inputs do not hit)."""
    acc = torch.zeros(weight.shape[0], dtype=torch.float32)
    for k in range(row.shape[0]):
        acc = (acc.double() + row[k].double() * weight[:, k].double()).float()
    return acc


def test_a_product_is_one_fused_multiply_add_after_another_in_feature_order():
    """What the kernels rest on, pinned on the machine the suite runs on: a BLAS that sums in
    blocks or with several accumulators gives other bits and fails here."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 300, generator=g), torch.randn(6, 300, generator=g)
    got = inv.linear(x, w)
    for i in range(6):
        assert torch.equal(got[i], _fma_chain(x[i], w)), i
    pairwise = x.double() @ w.double().t()       # the negative control: another order
    assert not torch.equal(pairwise.float(), got)


def test_the_products_gradient_is_the_librarys():
    g = torch.Generator().manual_seed(4)
    w, b, x = (torch.randn(48, 20, generator=g).requires_grad_(), torch.randn(48, generator=g).requires_grad_(),
               torch.randn(2, 7, 20, generator=g).requires_grad_())
    up = torch.randn(2, 7, 48, generator=g)
    (inv.linear(x, w, b) * up).sum().backward()
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    (F.linear(x, w, b) * up).sum().backward()
    for a, t in zip(got, (x, w, b)):
        assert torch.allclose(a, t.grad, atol=1e-5)
    assert inv.linear(torch.randn(0, 20), w).shape == (0, 48)


def test_silu_is_the_same_at_every_place_and_close_to_torchs():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1)) * 4
    ref = inv.silu(x)
    for shift in (1, 3, 7, 13):
        assert torch.equal(inv.silu(x[shift:]), ref[shift:])
    assert torch.equal(torch.cat([inv.silu(x[i:i + 5]) for i in range(0, 2000, 5)]), ref[:2000])
    assert torch.allclose(ref, F.silu(x), rtol=1e-6, atol=1e-7)


def _qkv(B, Hq, Hkv, S, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g),
            torch.randn(B, Hkv, S, D, generator=g))


def test_attention_equals_causal_softmax_attention():
    q, k, v = _qkv(2, 4, 2, 150)
    got = inv.attention(q, k, v, inv.causal_positions(2, 0, 150, "cpu"))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(got, ref, atol=1e-5)


def test_a_query_past_several_key_chunks_gets_its_bits_alone_and_in_a_prefill():
    """Prefill tiles sum more than KEY_CHUNK keys chunk by chunk, each bag's sum carried into
    the next chunk; a decode step sums by rows in one chain. The same bits."""
    n = 2 * inv.KEY_CHUNK + 300
    q, k, v = _qkv(1, 4, 2, n, seed=9)
    full = inv.attention(q, k, v, inv.causal_positions(1, 0, n, "cpu"))
    for at in (inv.KEY_CHUNK - 1, inv.KEY_CHUNK, 2 * inv.KEY_CHUNK + 7, n - 1):
        alone = inv.attention(q[:, :, at:at + 1], k[:, :, :at + 1], v[:, :, :at + 1], torch.tensor([[at]]))
        assert torch.equal(alone, full[:, :, at:at + 1]), at
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(full, ref, atol=1e-5)


def test_attention_gradient_is_plain_softmax_attentions():
    """Under autograd the bag-sum forward keeps its bits and the gradient is plain attention's
    (recomputed by SDPA per tile of queries), with grouped-query heads summed into k and v."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 300, seed=7))
    q_pos = inv.causal_positions(1, 0, 300, "cpu")
    out = inv.attention(q, k, v, q_pos)
    with torch.no_grad():
        assert torch.equal(out, inv.attention(q, k, v, q_pos))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    for a, b in zip(got, torch.autograd.grad(ref, (q, k, v), grad)):
        assert torch.allclose(a, b, atol=1e-5)


def test_attention_bits_depend_only_on_a_querys_own_keys():
    """One query (position 100) computed alone, in a chunk, in a batch with longer rows
    and garbage past its position, with more padding: the same bits."""
    q, k, v = _qkv(1, 4, 2, 300, seed=3)
    pos = torch.tensor([[100]])
    alone = inv.attention(q[:, :, 100:101], k[:, :, :101], v[:, :, :101], pos)
    chunk = inv.attention(q[:, :, 90:130], k[:, :, :130], v[:, :, :130], torch.arange(90, 130)[None])[:, :, 10:11]
    assert torch.equal(alone, chunk)
    garbage_k, garbage_v = k.clone(), v.clone()
    garbage_k[:, :, 101:] = 7.0
    garbage_v[:, :, 101:] = -3.0
    q2, k2, v2 = _qkv(3, 4, 2, 300, seed=4)
    batch_q = torch.cat([q2[:1, :, :1], q[:, :, 100:101], q2[1:2, :, :1]])
    batch_k = torch.cat([k2[:1], garbage_k, k2[1:2]])
    batch_v = torch.cat([v2[:1], garbage_v, v2[1:2]])
    batched = inv.attention(batch_q, batch_k, batch_v, torch.tensor([[299], [100], [250]]))[1:2]
    assert torch.equal(alone, batched)


def test_a_bag_sum_is_one_fused_multiply_add_after_another():
    """What the attention rests on: per output element, embedding_bag takes fma(w, x, acc)
    term by term from 0 (emulated here in float64, where w * x is exact), so trailing
    zero-weight terms and other lanes of the table change no bit."""
    g = torch.Generator().manual_seed(5)
    table, w = torch.randn(300, 37, generator=g), torch.randn(300, generator=g)

    def bag(n, width=37, pad=0):
        weights = torch.cat([w[:n], torch.zeros(pad)])
        return F.embedding_bag(torch.arange(n + pad), table[:n + pad, :width].contiguous(), torch.tensor([0]),
                               mode="sum", per_sample_weights=weights)[0]

    chain = torch.zeros(37)
    for i in range(250):
        chain = (w[i].double() * table[i].double() + chain.double()).float()
    assert torch.equal(bag(250), chain)
    assert torch.equal(bag(250, pad=50), chain)
    assert torch.equal(bag(250, width=5), chain[:5]) and torch.equal(bag(250, width=16), chain[:16])
    plain = torch.zeros(37)
    for i in range(250):
        plain = plain + w[i] * table[i]
    assert not torch.equal(bag(250), plain)   # the negative control: two roundings per term differ


def test_invariant_forward_is_close_to_the_native_one():
    model = build_model("tiny", seed=2)
    ids = torch.randint(0, 500, (2, 70), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(70)[None].expand(2, 70)
    with torch.no_grad():
        a = model(ids, pos, invariant=True)
        b = model(ids, pos)
    assert torch.allclose(a, b, atol=1e-4)


def test_round_up_gives_whole_tiles():
    assert inv.round_up(0, 64) == 0 and inv.round_up(1, 64) == 64
    assert inv.round_up(64, 64) == 64 and inv.round_up(65, 64) == 128 and inv.round_up(5, 4) == 8


def test_a_callers_memo_of_masks_and_index_lists_stays_bounded_and_serves_again():
    memo: dict = {}
    first = inv.KeyMask.causal(0, 40, 2, "cpu", memo)
    assert inv.KeyMask.causal(0, 40, 2, "cpu", memo) is first              # prompts of one length share it
    for span in range(1, 400):
        idx, off = first.bags(4, 2, 700, 0, span)
        assert idx.numel() == 8 * span and idx[span - 1] == span - 1 and idx[-1] == 3 * 700 + span - 1
        assert len(memo) <= inv.MAX_KEPT + 2 and memo["kept indices"] <= inv.MAX_KEPT_INDICES
    idx, off = first.key_bags(30, 2, 4)                                     # a prefix of the list for more keys
    assert torch.equal(idx, torch.arange(8).repeat(30)) and torch.equal(off, torch.arange(60) * 4)
    idx, off = first.chained_bags(2, 3, 5)          # its running sum first, then the chunk's rows of its group
    assert idx.view(6, 6)[4].tolist() == [4, 7, 9, 11, 13, 15] and off.tolist() == [0, 6, 12, 18, 24, 30]

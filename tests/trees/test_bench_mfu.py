"""bench trees' model FLOP utilisation: the FLOP count of a known shape and the GEMM reference."""
import numpy as np
import torch

from gyre_hpc.bench.mfu import attention_pairs, gemm_rate, layer_shapes, step_flops
from gyre_hpc.models.decoder import PRESETS, LMConfig


def test_step_flops_of_a_known_shape_equal_the_formula():
    # d=64, 4 heads of 16 (2 kv heads), d_ff=96, 3 layers, vocabulary 100.
    cfg = LMConfig(vocab_size=100, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96)
    # q 64x64, k and v 64x32, o 64x64, gate and up 64x96, down 96x64
    per_layer_params = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96
    assert sum(i * o for i, o in layer_shapes(cfg)) == per_layer_params
    f = step_flops(cfg, packed_tokens=10, attention_pairs=55, head_tokens=4)
    assert f.projections == 3 * 2 * per_layer_params * 3 * 10
    assert f.attention == 3 * 4 * 16 * 4 * 3 * 55
    assert f.head == 3 * 2 * 64 * 100 * 4
    assert f.total == f.projections + f.attention + f.head


def test_attention_pairs_count_each_tokens_visible_prefix():
    # two documents of 3 and 2 tokens (positions restart): 1+2+3 + 1+2
    assert attention_pairs(np.array([0, 1, 2, 0, 1])) == 9


def test_gemm_rate_measures_the_model_mix_at_the_callers_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = gemm_rate(PRESETS["tiny"], tokens=64, repeats=2)
    finally:
        torch.set_num_threads(before)
    assert g["flop_s"] > 0 and g["threads"] == 1 and g["tokens"] == 64

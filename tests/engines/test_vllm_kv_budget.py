"""The vLLM adapter's CPU KV budget holds a max-length sequence of the model it serves."""
from gyre_hpc.engines.vllm_engine import kv_bytes_per_token
from gyre_hpc.models.decoder import LMConfig


def test_kv_bytes_per_token_of_smollm2s_shape():
    # SmolLM2-135M: 30 layers, 3 kv heads of 64; K and V in float32. 8K tokens: 0.35 GiB, more
    # than the 256 MiB the adapter reserved before (vLLM refused to start).
    cfg = LMConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536)
    assert kv_bytes_per_token(cfg) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(cfg, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(cfg) * 8192 > 256 << 20

import dataclasses
import json

import pytest
import torch

from gyre_hpc.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from gyre_hpc.models.decoder import PRESETS, LMConfig, build_model

V = PRESETS["tiny"].vocab_size


def _ids(B, T, seed=0, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def _pos(B, T, start=0):
    return torch.arange(start, start + T).expand(B, T)


def test_presets_build_deterministic_weights_from_seed():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    for (k, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), k
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.config.d_model == 64 and a.config.n_layers == 2 and a.config.n_heads == 2
    assert build_model("small").n_params > a.n_params
    assert set(PRESETS) >= {"tiny", "small"}
    # vLLM's CPU attention needs head size >= 32; the presets use grouped-query attention
    assert all(p.dh >= 32 and p.kv_heads < p.n_heads for p in PRESETS.values())


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match="tiny, small"):
        build_model("huge")


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="n_heads"):
        LMConfig(d_model=64, n_heads=5)
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        LMConfig(d_model=64, n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="family='gpt2'"):
        LMConfig(family="gpt2")


def test_forward_shapes_and_causality():
    model = build_model("tiny", seed=0)
    ids = _ids(2, 12)
    logits = model(ids, _pos(2, 12))
    assert logits.shape == (2, 12, V)
    # Changing a later token must not change earlier logits (causal).
    ids2 = ids.clone()
    ids2[:, 8] = (ids2[:, 8] + 1) % V
    logits2 = model(ids2, _pos(2, 12))
    torch.testing.assert_close(logits[:, :8], logits2[:, :8])
    assert not torch.allclose(logits[:, 8:], logits2[:, 8:])


def test_kv_cache_decode_equals_full_forward():
    model = build_model("tiny", seed=3).double()
    ids = _ids(2, 20, seed=4)
    full = model(ids, _pos(2, 20))
    # Prefill 13 tokens, then decode one at a time, then a 3-token chunk.
    logits, past = model(ids[:, :13], _pos(2, 13), use_cache=True)
    steps = [logits]
    for t in range(13, 17):
        lg, past = model(ids[:, t:t + 1], _pos(2, 1, t), past_kv=past, use_cache=True)
        steps.append(lg)
    lg, past = model(ids[:, 17:], _pos(2, 3, 17), past_kv=past, use_cache=True)
    steps.append(lg)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-12, atol=1e-12)
    assert past[0][0].shape == (2, 1, 20, 32)   # the kv heads only (GQA)


def test_explicit_bool_mask_matches_default_causal():
    model = build_model("tiny", seed=5)
    ids = _ids(1, 10)
    mask = torch.tril(torch.ones(10, 10, dtype=torch.bool))
    torch.testing.assert_close(model(ids, _pos(1, 10), attn_mask=mask), model(ids, _pos(1, 10)))


def test_attention_fn_replaces_the_kernel():
    model = build_model("tiny", seed=5)
    ids = _ids(1, 10)
    seen = []

    def causal(q, k, v):
        seen.append(q.shape)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.testing.assert_close(model(ids, _pos(1, 10), attention_fn=causal), model(ids, _pos(1, 10)))
    assert len(seen) == model.config.n_layers
    # A non-causal kernel changes the result, so the hook is really used.
    full = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)  # noqa: E731
    assert not torch.allclose(model(ids, _pos(1, 10), attention_fn=full), model(ids, _pos(1, 10)))
    with pytest.raises(ValueError, match="not both"):
        model(ids, _pos(1, 10), attn_mask=torch.ones(10, 10, dtype=torch.bool), attention_fn=causal)


def test_mismatched_shapes_and_cache_depth_are_named():
    model = build_model("tiny")
    with pytest.raises(ValueError, match="position_ids"):
        model(_ids(1, 5), _pos(1, 4))
    _, past = model(_ids(1, 5), _pos(1, 5), use_cache=True)
    with pytest.raises(ValueError, match="past_kv has 1 layers"):
        model(_ids(1, 1), _pos(1, 1, 5), past_kv=past[:1])


def test_position_ids_shift_is_relative():
    """RoPE: a sequence at positions p..p+T scores like at 0..T (attention sees only offsets)."""
    model = build_model("tiny", seed=6).double()
    ids = _ids(1, 16)
    torch.testing.assert_close(model(ids, _pos(1, 16, 40000)), model(ids, _pos(1, 16)), rtol=1e-8, atol=1e-8)


def test_float64_forward_and_backward():
    model = build_model("tiny", seed=7).double()
    logits = model(_ids(2, 9), _pos(2, 9))
    assert logits.dtype == torch.float64
    logits.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float64 for p in model.parameters())


def test_untied_head_has_its_own_weight():
    model = build_model(LMConfig(tie_embeddings=False), seed=0)
    assert "lm_head.weight" in model.state_dict()
    assert model(_ids(1, 4), _pos(1, 4)).shape == (1, 4, V)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("invariant", [False, True])
def test_head_false_gives_the_hidden_states_the_output_weight_turns_into_the_logits(tied, invariant):
    from gyre_hpc.models import invariant as inv

    model = build_model(LMConfig(tie_embeddings=tied), seed=4)
    ids, pos = _ids(1, 6), _pos(1, 6)
    hidden = model(ids, pos, head=False, invariant=invariant)
    assert hidden.shape == (1, 6, model.config.d_model)
    assert model.output_weight is (model.model.embed_tokens.weight if tied else model.lm_head.weight)
    head = inv.linear(hidden, model.output_weight) if invariant else hidden @ model.output_weight.T
    assert torch.equal(head, model(ids, pos, invariant=invariant))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tied", [True, False])
def test_checkpoint_round_trip(tmp_path, dtype, tied):
    model = build_model(dataclasses.replace(PRESETS["tiny"], tie_embeddings=tied), seed=8).to(dtype)
    save_pretrained(model, tmp_path / "ck", extra={"step": 3})
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (64, 2, 2)
    assert cfg["num_key_value_heads"] == 1 and cfg["head_dim"] == 32
    assert cfg["vocab_size"] == V and cfg["max_position_embeddings"] == 32768
    assert cfg["intermediate_size"] == 172 and cfg["rope_theta"] == 10000.0
    assert cfg["gyre"] == {"step": 3}
    loaded = load_pretrained(tmp_path / "ck")
    assert loaded.config == model.config
    for k, v in model.state_dict().items():
        assert loaded.state_dict()[k].dtype == dtype
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = _ids(1, 7)
    torch.testing.assert_close(loaded(ids, _pos(1, 7)), model(ids, _pos(1, 7)), rtol=0, atol=0)


def test_checkpoint_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="config.json does not exist"):
        load_pretrained(tmp_path)
    save_pretrained(build_model("tiny"), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors does not exist"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "vocab_size": V}))
    with pytest.raises(CheckpointError, match="missing keys hidden_size"):
        load_pretrained(tmp_path)


def test_checkpoint_shape_mismatch_names_the_tensor(tmp_path):
    save_pretrained(build_model("tiny"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gate_proj.weight has shape"):
        load_pretrained(tmp_path)


def test_checkpoint_of_an_unsupported_architecture_names_the_file(tmp_path):
    save_pretrained(build_model("tiny"), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"config.json: architectures=\['GPT2LMHeadModel'\] is not supported"):
        load_pretrained(tmp_path)


def test_checkpoint_with_renamed_weights_names_the_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    save_pretrained(build_model("tiny"), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["model.layers.0.self_attn.qproj.weight"] = state.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.0.self_attn.q_proj.weight'\], "
                                              r"unexpected tensors \['model.layers.0.self_attn.qproj.weight'\]"):
        load_pretrained(tmp_path)


class _ListCache:
    """A minimal contract-1 hook: per-layer k, v lists, SDPA over past + new (causal within new)."""

    def __init__(self, n_layers):
        self.k = [None] * n_layers
        self.v = [None] * n_layers
        self.shapes = []

    def attend(self, layer, q, k, v):
        self.shapes.append((tuple(q.shape), tuple(k.shape)))
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], 2)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], 2)
        K, Vv = self.k[layer], self.v[layer]
        rep = q.shape[1] // K.shape[1]
        K, Vv = K.repeat_interleave(rep, 1), Vv.repeat_interleave(rep, 1)
        T, S = q.shape[2], K.shape[2]
        mask = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
        return torch.nn.functional.scaled_dot_product_attention(q, K, Vv, attn_mask=mask)


def test_kv_cache_hook_receives_new_tokens_only_and_matches_full_forward():
    model = build_model("small", seed=3).double()
    ids = _ids(2, 15, seed=4)
    full = model(ids, _pos(2, 15))
    cache = _ListCache(model.config.n_layers)
    steps = [model(ids[:, :9], _pos(2, 9), kv_cache=cache)]
    for t in range(9, 15):
        steps.append(model(ids[:, t:t + 1], _pos(2, 1, t), kv_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-12, atol=1e-12)
    cfg = model.config
    assert cache.shapes[0] == ((2, cfg.n_heads, 9, cfg.dh), (2, cfg.kv_heads, 9, cfg.dh))
    assert cache.shapes[-1] == ((2, cfg.n_heads, 1, cfg.dh), (2, cfg.kv_heads, 1, cfg.dh))
    with pytest.raises(ValueError, match="pass it alone"):
        model(ids, _pos(2, 15), kv_cache=cache, use_cache=True)


def test_attention_fn_sees_kv_expanded_to_every_query_head():
    model = build_model("small", seed=5)
    seen = []

    def causal(q, k, v):
        seen.append((q.shape[1], k.shape[1], v.shape[1]))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    model(_ids(1, 6), _pos(1, 6), attention_fn=causal)
    assert seen == [(4, 4, 4)] * model.config.n_layers

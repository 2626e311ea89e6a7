"""GGUF import: a tiny Llama written as a GGUF by the test (the ``gguf`` package's writer, with
llama.cpp's q/k permutation, one Q8_0, one Q4_0 and one F16 tensor), imported, then read by
our loader and by transformers, from the folder and from the GGUF itself."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from gyre_hpc.cli import main
from gyre_hpc.models.checkpoint import CheckpointError, is_checkpoint, load_pretrained
from gyre_hpc.models.decoder import CausalLM, LMConfig
from gyre_hpc.models.gguf_import import (convert, gguf_tokenizer, hf_state, import_gguf, lm_config, read_gguf,
                                         unpermute_rows)
from gyre_hpc.models.tokenizer import CHAT_TEMPLATE, build_bpe, load_tokenizer

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (the test extra has it)")
Q = gguf.GGMLQuantizationType

TEXTS = ["Create mathx.py with a function add(a, b) that returns a + b.", "hello world, the tests pass 12345",
         "def square(x):\n    return x * x\n"] * 4
CFG = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_position=256, rope_theta=5e5,
           norm_eps=1e-5, family="llama", qkv_bias=False, tie_embeddings=False)
# HF name (after model.layers.N.) -> GGUF name (after blk.N.); and the top-level tensors.
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
STORED_AS = {"blk.1.ffn_down.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.F16}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (what the importer must undo)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of ``llama_cpp_permute``, from its row order alone (not the importer's code)."""
    order = llama_cpp_permute(np.arange(w.shape[0]), n_heads)
    return w[np.argsort(order)]


def gguf_name(hf: str) -> str:
    stem, kind = hf.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, n, rest = stem.split(".", 3)
        return f"blk.{n}.{BLOCK[rest]}.{kind}"
    return f"{TOP[stem]}.{kind}"


def write_gguf(path: Path, model: CausalLM, tok, arch: str = "llama", pre: str = "default",
               stored_as: dict | None = None, extra_tensor: tuple | None = None) -> dict[str, np.ndarray]:
    """Write ``model`` as llama.cpp would; returns the HF-layout float32 weights as stored (after quantization)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_rope_dimension_count(cfg.dh)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    backend = json.loads(tok.backend.to_str())
    vocab = backend["model"]["vocab"] | {t["content"]: t["id"] for t in backend["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    specials = {t["content"] for t in backend["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in backend["model"]["merges"]])
    w.add_eos_token_id(tok.eos_id)
    w.add_pad_token_id(tok.pad_id)
    w.add_chat_template(tok.chat_template)
    stored = {}
    for hf, tensor in model.state_dict().items():
        name = gguf_name(hf)
        values = tensor.detach().float().numpy()
        heads = {"attn_q": cfg.n_heads, "attn_k": cfg.kv_heads}.get(name.split(".")[2] if name.startswith("blk") else "")
        if heads:
            values = llama_cpp_permute(values, heads)
        kind = (stored_as or {}).get(name, Q.F32)
        if kind in (Q.F32, Q.F16):
            data = values.astype(np.float16 if kind == Q.F16 else np.float32)
            w.add_tensor(name, data)
            back = data.astype(np.float32)
        else:
            data = gguf.quants.quantize(values, kind)
            w.add_tensor(name, data, raw_dtype=kind)
            back = gguf.quants.dequantize(data, kind)
        stored[hf] = llama_cpp_unpermute(back, heads) if heads else back
    if extra_tensor is not None:
        name, data, *kind = extra_tensor
        w.add_tensor(name, data, raw_dtype=kind[0] if kind else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def tokenizer():
    return build_bpe(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def reference(tokenizer):
    """A random tiny Llama in HF layout (every tensor randomised, so no permutation hides behind symmetry)."""
    torch.manual_seed(0)
    model = CausalLM(LMConfig(vocab_size=tokenizer.vocab_size, **CFG))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def written(tmp_path_factory, reference, tokenizer):
    """The GGUF file, and the reference model holding exactly the weights it stores (dequantized)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    stored = write_gguf(path, reference, tokenizer, stored_as=STORED_AS)
    exact = CausalLM(reference.config)
    exact.load_state_dict({k: torch.from_numpy(v) for k, v in stored.items()})
    return path, exact.eval()


def _ids(tokenizer, text="Create mathx.py with a function add(a, b) that returns a + b."):
    ids = torch.tensor([tokenizer.encode(text)])
    return ids, torch.arange(ids.shape[1])[None]


def test_unpermute_rows_undoes_llama_cpps_permutation():
    rows = np.arange(8, dtype=np.float32)
    # One head of 8 rows: llama.cpp interleaves the halves (0 1 2 3 | 4 5 6 7) as pairs.
    assert llama_cpp_permute(rows, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute_rows(np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.float32), 1).tolist() == list(range(8))
    w = np.random.default_rng(0).standard_normal((16, 3)).astype(np.float32)
    assert np.array_equal(unpermute_rows(llama_cpp_permute(w, 2), 2), w)
    assert not np.array_equal(unpermute_rows(llama_cpp_permute(w, 2), 4), w), "the head count must matter"


def test_read_gguf_dequantizes_to_hf_shapes(written, reference):
    path, exact = written
    model = read_gguf(path)
    assert model.metadata["general.architecture"] == "llama"
    down = model.tensors["blk.1.ffn_down.weight"]
    assert down.shape == (64, 96) and down.dtype == np.float32
    # Q8_0 keeps ~2 decimal digits: close to the reference, not equal to it.
    ref = reference.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy()
    assert 0 < np.abs(down - ref).max() < 0.02
    assert lm_config(model) == reference.config
    state = hf_state(model, lm_config(model))
    torch.testing.assert_close(state["model.layers.0.self_attn.k_proj.weight"],
                               exact.state_dict()["model.layers.0.self_attn.k_proj.weight"], rtol=0, atol=0)


def test_imported_folder_matches_the_gguf_in_our_loader(written, tokenizer, tmp_path):
    path, exact = written
    out = import_gguf(path, tmp_path / "ckpt")
    assert is_checkpoint(out)
    ours = load_pretrained(out, dtype=torch.float32)
    ids, pos = _ids(tokenizer)
    with torch.no_grad():
        got, want = ours(ids, pos), exact(ids, pos)
    assert want.abs().max() > 1.0, "the test model must not have flat logits"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    tok = load_tokenizer(out)
    assert tok.chat_template == CHAT_TEMPLATE and tok.eos_token == "<|im_end|>"
    for text in TEXTS[:3] + ["<|im_start|>user\nunseen words 987<|im_end|>"]:
        assert tok.encode(text) == tokenizer.encode(text)
    assert json.loads((out / "config.json").read_text())["gyre"] == {"imported_from": "tiny-llama.gguf"}


def test_imported_folder_matches_transformers_own_gguf_load(written, tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate (the test extra has it)")
    path, exact = written
    out = import_gguf(path, tmp_path / "ckpt")
    from_folder = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    from_gguf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    ids, pos = _ids(tokenizer)
    with torch.no_grad():
        theirs = from_gguf(input_ids=ids).logits
        torch.testing.assert_close(from_folder(input_ids=ids).logits, theirs, rtol=0, atol=1e-5)
        torch.testing.assert_close(exact(ids, pos), theirs, rtol=0, atol=1e-5)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert hf_tok.encode(prompt, add_special_tokens=False)[:1] == [tokenizer.special("<|im_start|>")]


def test_the_cli_imports_and_refuses_to_overwrite(written, tmp_path):
    path, _ = written
    out = tmp_path / "cli-ckpt"
    first = CliRunner().invoke(main, ["models", "import-gguf", str(path), str(out)])
    assert first.exit_code == 0, first.output
    assert is_checkpoint(out) and f"checkpoint: {out}" in first.output
    again = CliRunner().invoke(main, ["models", "import-gguf", str(path), str(out)])
    assert again.exit_code != 0 and "already exists" in again.output
    forced = CliRunner().invoke(main, ["models", "import-gguf", str(path), str(out), "--force", "--dtype", "bfloat16"])
    assert forced.exit_code == 0, forced.output
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder is left behind"


def test_an_unsupported_architecture_is_named(tmp_path, reference, tokenizer):
    path = tmp_path / "other.gguf"
    write_gguf(path, reference, tokenizer, arch="mamba")
    with pytest.raises(CheckpointError, match=r"other.gguf: general.architecture='mamba' cannot be converted "
                                              r"\(supported: llama\)"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unsupported_quantization_is_named(tmp_path, reference, tokenizer):
    path = tmp_path / "q81.gguf"
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((4, 64 // block * size), dtype=np.uint8)
    write_gguf(path, reference, tokenizer, extra_tensor=("blk.0.odd.weight", raw, Q.Q8_1))
    with pytest.raises(CheckpointError, match=r"q81.gguf: tensor blk.0.odd.weight is stored as Q8_1, which the gguf "
                                              r"package cannot dequantize"):
        read_gguf(path)


def test_an_unknown_tensor_and_an_unknown_pre_tokenizer_are_named(tmp_path, reference, tokenizer):
    path = tmp_path / "extra.gguf"
    write_gguf(path, reference, tokenizer, pre="qwen2",
               extra_tensor=("rope_freqs.weight", np.ones(8, dtype=np.float32)))
    model = read_gguf(path)
    with pytest.raises(CheckpointError, match=r"extra.gguf: tensor rope_freqs.weight has no counterpart"):
        convert(model)
    with pytest.raises(CheckpointError, match=r"extra.gguf: tokenizer.ggml.pre='qwen2' cannot be converted"):
        gguf_tokenizer(model)


def test_smollm_pre_tokenizer_splits_digits_one_by_one(tmp_path, reference, tokenizer):
    path = tmp_path / "smollm.gguf"
    write_gguf(path, reference, tokenizer, pre="smollm")
    tok = gguf_tokenizer(read_gguf(path))
    assert [tok.decode([i]) for i in tok.encode("x 12345")] == ["x", " ", "1", "2", "3", "4", "5"]
    assert len(tokenizer.encode("12345")) < 5, "the test's BPE must have merged digits for this to show anything"


def test_a_file_that_is_not_a_gguf_is_named(tmp_path, written):
    with pytest.raises(CheckpointError, match=r"GGUF file .*absent.gguf does not exist"):
        read_gguf(tmp_path / "absent.gguf")
    (tmp_path / "text.gguf").write_text("not a gguf file")
    with pytest.raises(CheckpointError, match=r"text.gguf is not a readable GGUF file: ValueError: GGUF magic invalid"):
        read_gguf(tmp_path / "text.gguf")
    (tmp_path / "cut.gguf").write_bytes(written[0].read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"cut.gguf is not a readable GGUF file"):
        read_gguf(tmp_path / "cut.gguf")


def test_a_missing_metadata_key_is_named(written):
    model = read_gguf(written[0])
    no_template = dict(model.metadata)
    del no_template["tokenizer.chat_template"]
    with pytest.raises(CheckpointError, match=r"tiny-llama.gguf: metadata key tokenizer.chat_template is missing"):
        gguf_tokenizer(type(model)(model.path, no_template, model.tensors))
    no_layers = dict(model.metadata)
    del no_layers["llama.block_count"]
    with pytest.raises(CheckpointError, match=r"tiny-llama.gguf: metadata key llama.block_count is missing"):
        lm_config(type(model)(model.path, no_layers, model.tensors))


def test_a_failed_import_leaves_nothing_behind(tmp_path, tokenizer):
    small = CausalLM(LMConfig(vocab_size=tokenizer.vocab_size - 10, **CFG))   # fewer rows than tokens
    path = tmp_path / "short-vocab.gguf"
    write_gguf(path, small, tokenizer)
    with pytest.raises(CheckpointError, match=rf"the tokenizer has {tokenizer.vocab_size} ids, the model's "
                                              rf"vocab_size is {tokenizer.vocab_size - 10}"):
        import_gguf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short-vocab.gguf"]

"""Our decoder against transformers' own classes: the same checkpoint folder, the same logits.

Each supported family is built from a random tiny ``transformers`` config (GQA, biases where
the family has them, tied and untied heads, Llama 3 rope scaling), saved by transformers,
loaded by us; then our checkpoint is opened by ``AutoModelForCausalLM``/``AutoTokenizer``
from the folder alone.
"""
from __future__ import annotations

import pytest
import torch

from gyre_hpc.models.checkpoint import CONFIG_FILE, CheckpointError, is_checkpoint, load_pretrained, save_pretrained
from gyre_hpc.models.decoder import build_model
from gyre_hpc.models.tokenizer import TokenizerError, embedded_tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2.5-untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False, rope_theta=5e5)),
    "llama3-scaled-biased": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
}


def _hf_model(kind: str, seed: int = 0):
    cls, extra = FAMILIES[kind]
    cfg = getattr(transformers, cls)(**COMMON, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():   # HF zero-inits biases and ones-inits norms: randomise every tensor
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def _inputs(vocab: int, T: int = 40):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (2, T), generator=g), torch.arange(T).expand(2, T)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_our_logits_match_transformers_on_its_checkpoint(tmp_path, kind):
    hf = _hf_model(kind)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    ids, pos = _inputs(COMMON["vocab_size"])
    with torch.no_grad():
        theirs = hf(input_ids=ids, position_ids=pos).logits
        mine = ours(ids, pos)
    assert theirs.abs().max() > 1.0, "the test model must not have flat logits"
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)


def test_our_checkpoint_loads_in_transformers_from_the_folder_alone(tmp_path):
    model = build_model("small", seed=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    text = "Create mathx.py with a function add(a, b)."
    assert tok.encode(text, add_special_tokens=False) == embedded_tokenizer().encode(text)
    ids = torch.tensor([embedded_tokenizer().encode(text)])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos), hf(input_ids=ids).logits, rtol=0, atol=1e-5)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_tokenizer_file_is_named(tmp_path):
    save_pretrained(build_model("tiny"), tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer file .*tokenizer.json does not exist"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json does not exist"):
        load_tokenizer(tmp_path)


def test_is_checkpoint_reads_the_config_file_save_pretrained_writes_last(tmp_path):
    assert not is_checkpoint(tmp_path)
    save_pretrained(build_model("tiny"), tmp_path)
    assert is_checkpoint(tmp_path)
    (tmp_path / CONFIG_FILE).unlink()          # a directory whose save stopped short
    assert not is_checkpoint(tmp_path)
    assert not is_checkpoint(tmp_path / "absent")


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model("qwen2-tied", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = load_pretrained(tmp_path, dtype=torch.float32)
    ids, pos = _inputs(COMMON["vocab_size"], 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, pos), hf(input_ids=ids, position_ids=pos).logits, rtol=0, atol=1e-5)
    next(tmp_path.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"model-00001-of-.*safetensors does not exist"):
        load_pretrained(tmp_path)

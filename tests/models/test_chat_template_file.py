"""``load_tokenizer`` finds the chat template where current transformers writes it:
``chat_template.jinja`` beside a ``tokenizer_config.json`` that has no ``chat_template``."""
from __future__ import annotations

import json

import pytest

from gyre_hpc.models.tokenizer import CHAT_TEMPLATE, TokenizerError, embedded_tokenizer, load_tokenizer

OTHER_TEMPLATE = "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{%- endfor %}"


def _without_template_field(folder):
    path = folder / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    del cfg["chat_template"]
    path.write_text(json.dumps(cfg))


def test_template_is_read_from_chat_template_jinja(tmp_path):
    embedded_tokenizer().save(tmp_path)
    _without_template_field(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    tok = load_tokenizer(tmp_path)
    assert tok.chat_template == OTHER_TEMPLATE
    assert tok.eos_id == embedded_tokenizer().eos_id


def test_the_config_field_wins_over_the_file(tmp_path):
    embedded_tokenizer().save(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(OTHER_TEMPLATE)
    assert load_tokenizer(tmp_path).chat_template == CHAT_TEMPLATE


def test_a_folder_transformers_saved_loads(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    embedded_tokenizer().save(tmp_path / "ours")
    transformers.AutoTokenizer.from_pretrained(str(tmp_path / "ours")).save_pretrained(str(tmp_path / "theirs"))
    saved = json.loads((tmp_path / "theirs" / "tokenizer_config.json").read_text())
    assert "chat_template" not in saved, "this transformers writes the template into the config: nothing to test"
    assert (tmp_path / "theirs" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert load_tokenizer(tmp_path / "theirs").chat_template == CHAT_TEMPLATE


def test_no_template_anywhere_names_both_files(tmp_path):
    embedded_tokenizer().save(tmp_path)
    _without_template_field(tmp_path)
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json has no chat_template and .*chat_template.jinja "
                                             r"does not exist"):
        load_tokenizer(tmp_path)

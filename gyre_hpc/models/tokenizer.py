"""Tokenizers: the embedded default (a small byte-level BPE shipped in the package) and any
checkpoint's own, behind one small class.

Why a real BPE even for the tiny model: checkpoints are HF folders that ``AutoTokenizer`` and
vLLM open as they are, and prompts are built with a chat template and the standard
``<tool_call>{json}</tool_call>`` format, so a policy trained here is served and read anywhere.
Why byte-level with few merges (512 ids): any UTF-8 text round-trips, and a tiny model still
sees short, regular tokens (bytes and the suite's common words) it can learn in a few steps.

The embedded vocabulary's special tokens come first, at fixed ids (see ``SPECIAL_TOKENS``);
they are never produced from text by :meth:`ChatTokenizer.encode`, so tool output cannot
forge a turn boundary or a tool call. ``scripts/build_tokenizer.py`` rebuilds the file
offline from the task suite's text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

from gyre_hpc.models.jsonfile import read_json_object

EMBEDDED_FILE = Path(__file__).with_name("embedded_tokenizer.json")
EMBEDDED_VOCAB_SIZE = 512
# Order fixes the ids 0..6 of the embedded vocabulary.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>")
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Where transformers >= 4.47 saves the template (the config then has no ``chat_template``),
# as many checkpoints on the hub now ship it.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

# The Qwen2.5 chat layout (ChatML, tool results as a user turn inside <tool_response>),
# without the tool-schema preamble: the system text states the tools itself.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class TokenizerError(ValueError):
    """A tokenizer folder or file that cannot be used; the message names the file."""


@dataclass(frozen=True, eq=False)
class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus its chat template and the ids the harness needs."""

    backend: object                       # tokenizers.Tokenizer
    chat_template: str
    eos_token: str
    pad_token: str

    # -- text <-> ids ------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of plain text; special-token strings inside it are encoded as ordinary text."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary 0..{self.vocab_size - 1}")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def special(self, token: str) -> int:
        """The id of a token the chat format needs; a clear error if this vocabulary lacks it."""
        i = self.token_id(token)
        if i is None:
            raise TokenizerError(f"the tokenizer has no {token!r} token")
        return i

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self.special(self.eos_token)

    @property
    def pad_id(self) -> int:
        return self.special(self.pad_token)

    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a model turn: EOS, the end-of-text token and (as one token) ``</tool_call>``."""
        ids = [self.eos_id]
        for t in (PAD_TOKEN, TOOL_CALL_END):
            i = self.token_id(t)
            if i is not None and i not in ids:
                ids.append(i)
        return tuple(ids)

    # -- HF folders ----------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) that
        ``transformers.AutoTokenizer`` and vLLM read from the folder alone."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(d / TOKENIZER_FILE))
        added = {}
        for i in range(self.vocab_size):
            tok = self.backend.id_to_token(i)
            if tok in SPECIAL_TOKENS:
                added[str(i)] = {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                                 "single_word": False, "special": True}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "bos_token": None,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": None,
            "chat_template": self.chat_template,
            "model_max_length": 1 << 20,
            "clean_up_tokenization_spaces": False,
        }
        (d / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def _backend_from_file(path: Path):
    from tokenizers import Tokenizer

    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises bare Exceptions for bad JSON
        raise TokenizerError(f"{path} is not a readable tokenizers file: {exc}") from None
    # Special-token strings in text are text: tool output cannot forge a turn or a call.
    tok.encode_special_tokens = True
    return tok


@lru_cache(maxsize=1)
def embedded_tokenizer() -> ChatTokenizer:
    """The default tokenizer shipped in the package (read once per process)."""
    tok = ChatTokenizer(_backend_from_file(EMBEDDED_FILE), CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN)
    if tok.vocab_size != EMBEDDED_VOCAB_SIZE or any(tok.token_id(t) != i for i, t in enumerate(SPECIAL_TOKENS)):
        raise TokenizerError(f"{EMBEDDED_FILE}: expected {EMBEDDED_VOCAB_SIZE} ids with {SPECIAL_TOKENS} first; "
                             f"rebuild it with scripts/build_tokenizer.py")
    return tok


def load_tokenizer(directory: str | Path) -> ChatTokenizer:
    """The tokenizer of an HF checkpoint folder (``tokenizer.json`` + ``tokenizer_config.json``);
    the chat template from the config's field, else from ``chat_template.jinja`` beside it."""
    d = Path(directory)
    cfg_path = d / TOKENIZER_CONFIG_FILE
    if not cfg_path.is_file():
        raise TokenizerError(f"checkpoint {d}: {cfg_path} does not exist (a checkpoint brings its tokenizer)")
    cfg = read_json_object(cfg_path, TokenizerError)
    backend = _backend_from_file(d / TOKENIZER_FILE)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # HF's list form: [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = d / CHAT_TEMPLATE_FILE
    if not template and jinja.is_file():
        template = jinja.read_text()
    if not template:
        raise TokenizerError(f"checkpoint {d}: no chat template: {cfg_path} has no chat_template "
                             f"and {jinja} does not exist (or is empty)")

    def content(key: str, default: str) -> str:
        v = cfg.get(key) or default
        return v["content"] if isinstance(v, dict) else v

    tok = ChatTokenizer(backend, template, content("eos_token", EOS_TOKEN), content("pad_token", PAD_TOKEN))
    tok.special(tok.eos_token)
    return tok


def build_bpe(texts: Sequence[str], vocab_size: int = EMBEDDED_VOCAB_SIZE) -> ChatTokenizer:
    """Train the embedded BPE from ``texts`` (deterministic for the same texts).

    Byte-level, GPT-2-style pre-tokenisation; the 256 byte symbols are always in the
    alphabet so no text is ever out of vocabulary; specials first at fixed ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.encode_special_tokens = True
    return ChatTokenizer(tok, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN)

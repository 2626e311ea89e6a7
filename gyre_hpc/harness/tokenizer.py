"""Prompts as token ids, built with the chat template, plus thin wrappers over the embedded tokenizer.

Why the harness builds ids turn by turn instead of re-rendering the whole conversation:
each prompt must extend the previous prompt + output token for token (the calls of one
context then share one path in the trajectory tree, and the trainer trains on exactly the
ids the engine saw). ``ChatFormat`` emits the pieces of the tokenizer's ChatML template
(``<|im_start|>role\\ntext<|im_end|>\\n``, tool results as a user turn inside
``<tool_response>``), encoding each text run between template markers in one piece, as
``apply_chat_template`` does; tests/harness check the two agree token for token.

``encode``/``decode``/``split_bytes`` are the embedded default tokenizer's, for code that
has no tokenizer object at hand; new code takes the run's tokenizer (a real checkpoint brings
its own).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gyre_hpc.models.tokenizer import EMBEDDED_VOCAB_SIZE, SPECIAL_TOKENS, ChatTokenizer, embedded_tokenizer

# The embedded vocabulary's fixed ids, for code written before tokenizers were objects.
PAD = SPECIAL_TOKENS.index("<|endoftext|>")
EOS = SPECIAL_TOKENS.index("<|im_end|>")
VOCAB_SIZE = EMBEDDED_VOCAB_SIZE

_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"
_RESPONSE_START, _RESPONSE_END = "<tool_response>", "</tool_response>"


def encode(text: str) -> list[int]:
    """Ids of ``text`` under the embedded tokenizer; special-token strings stay text."""
    return embedded_tokenizer().encode(text)


def decode(ids: Iterable[int], show_specials: bool = False) -> str:
    """Text of the ids; specials are dropped (or shown, for logs). Unknown ids raise ValueError."""
    return embedded_tokenizer().decode(ids, skip_special_tokens=not show_specials)


def split_bytes(ids: Sequence[int]) -> bytes:
    """The UTF-8 bytes of the ids' text, specials dropped."""
    return decode(ids).encode("utf-8")


def truncate_utf8(text: str, max_bytes: int) -> str:
    """At most ``max_bytes`` bytes of ``text``, never splitting a character."""
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore")


@dataclass(frozen=True)
class ChatFormat:
    """The chat template's pieces as ids, for one tokenizer."""

    tokenizer: ChatTokenizer

    def _render(self, *parts: str) -> list[int]:
        """Template markers that are single tokens become their ids; the text between them is
        encoded as one run (content may contain marker strings: they stay text)."""
        ids: list[int] = []
        run: list[str] = []
        for part in parts:
            tid = self.tokenizer.token_id(part) if part in (_IM_START, _IM_END, _RESPONSE_START, _RESPONSE_END) else None
            if tid is None:
                run.append(part)
                continue
            if run:
                ids += self.tokenizer.encode("".join(run))
                run = []
            ids.append(tid)
        if run:
            ids += self.tokenizer.encode("".join(run))
        return ids

    def message(self, role: str, text: str) -> list[int]:
        return self._render(_IM_START, f"{role}\n{text}", _IM_END, "\n")

    def tool_result(self, text: str) -> list[int]:
        return self._render(_IM_START, "user\n", _RESPONSE_START, f"\n{text}\n", _RESPONSE_END, _IM_END, "\n")

    def generation_prompt(self) -> list[int]:
        return self._render(_IM_START, "assistant\n")

    def end_of_turn(self, output: Sequence[int]) -> list[int]:
        """What closes an assistant turn after ``output``: ``<|im_end|>`` unless the model
        emitted it (a tool call stops at ``</tool_call>``, a budget cut anywhere), then a newline."""
        eos = self.tokenizer.eos_id
        return ([] if output and int(output[-1]) == eos else [eos]) + self.tokenizer.encode("\n")

    def stop_ids(self) -> tuple[int, ...]:
        return self.tokenizer.stop_ids()

    def text(self, ids: Sequence[int]) -> str:
        """An output's text with specials dropped (what a summary or an answer keeps)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

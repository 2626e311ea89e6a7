"""Messages to token ids through a checkpoint's own chat template, as ``apply_chat_template`` does.

Why not transformers: the endpoint runs on the controller, which has the checkpoint's
``ChatTokenizer`` (``tokenizers`` + the template string) and no reason to load transformers.
The template is rendered with jinja2 the way transformers renders it (a sandboxed environment,
``trim_blocks``/``lstrip_blocks``, ``tojson`` and ``raise_exception``), so any hub template works.

Encoding: the rendered text is split at the vocabulary's special-token strings, each becomes
its id, and the text between two of them is encoded as one run. That is what a HF tokenizer
does with a rendered template, and it makes encoding compositional at special tokens: the
tokens of ``a + b`` are the tokens of ``a`` and of ``b`` whenever ``b`` starts with one, which
is what lets the session context append only the new turns (``session_context``). Unlike the
harness's ``ChatFormat``, a special-token string inside a message's content becomes the
special token here (the scaffold's own text is trusted as HF and vLLM trust it).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from gyre_hpc.models.tokenizer import ChatTokenizer


class ChatTemplateError(ValueError):
    """The chat template could not render these messages; the message says why."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@dataclass(frozen=True, eq=False)
class ChatRenderer:
    """One tokenizer's template and special-token split, compiled once."""

    tokenizer: ChatTokenizer

    @cached_property
    def _template(self):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(self.tokenizer.chat_template)

    @cached_property
    def _specials(self) -> tuple[re.Pattern | None, dict[str, int]]:
        decoder = self.tokenizer.backend.get_added_tokens_decoder()
        ids = {tok.content: i for i, tok in decoder.items() if tok.special}
        if not ids:
            return None, ids
        # longest first, so a special that is a prefix of another never splits it
        alternatives = sorted(ids, key=len, reverse=True)
        return re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")"), ids

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool, tools: Sequence[dict] | None = None,
               tool_choice=None) -> str:
        """The template's text for ``messages``; ``tools``/``tool_choice`` are passed to it as
        transformers passes them (a template that ignores them renders without them)."""
        try:
            return self._template.render(messages=list(messages), tools=list(tools) if tools else None,
                                         tool_choice=tool_choice, add_generation_prompt=add_generation_prompt,
                                         bos_token="", eos_token=self.tokenizer.eos_token)
        except ChatTemplateError:
            raise
        except Exception as exc:  # noqa: BLE001 - jinja raises many types; the caller needs one with the reason
            raise ChatTemplateError(f"the chat template failed on these messages: {type(exc).__name__}: {exc}") from None

    def encode(self, text: str) -> list[int]:
        """Ids of rendered text: special-token strings become their ids, the runs between them
        are encoded one piece each."""
        pattern, ids = self._specials
        if pattern is None:
            return self.tokenizer.encode(text)
        out: list[int] = []
        for i, piece in enumerate(pattern.split(text)):
            if i % 2:
                out.append(ids[piece])
            elif piece:
                out += self.tokenizer.encode(piece)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of sampled ids with their special tokens as written (what ``encode`` reads back)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

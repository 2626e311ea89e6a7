"""Byte-level tokenizer shared by the harness, the tiny model and the engines.

Why bytes: a tiny model needs no learned vocabulary, any UTF-8 text (code, tool output,
file names) round-trips exactly, and tool output can be truncated at any byte count.
Ids 0..255 are the bytes themselves; 256..263 are specials. The tool-call specials are
single tokens so a tiny model learns the call syntax as "one special, one letter".
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

PAD = 256
BOS = 257
EOS = 258
CALL = 259        # starts a tool call: CALL <letter> [arg] [SEP arg] END
END = 260         # ends a tool call (and stops decoding)
ENV = 261         # the environment speaks: tool result / task text follows
AGENT = 262       # the agent speaks next: every model prompt ends with this token
SEP = 263         # separates tool-call arguments (write: path SEP content)
VOCAB_SIZE = 264

SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", CALL: "<call>", END: "<end>",
                 ENV: "<env>", AGENT: "<agent>", SEP: "<sep>"}


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text``; specials never come out of encode, so user text cannot forge them."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int], show_specials: bool = False) -> str:
    """Text of the byte ids; specials are dropped (or shown as ``<call>`` etc. for logs).

    Invalid UTF-8 (a tiny model emits any byte sequence) decodes with U+FFFD replacements
    rather than failing, because every model output must map to some action.
    """
    out: list[str] = []
    buf = bytearray()
    for i in ids:
        i = int(i)
        if 0 <= i < 256:
            buf.append(i)
            continue
        if i not in SPECIAL_NAMES:
            raise ValueError(f"token id {i} is outside the byte-level vocabulary 0..{VOCAB_SIZE - 1}")
        if show_specials:
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(SPECIAL_NAMES[i])
    out.append(buf.decode("utf-8", errors="replace"))
    return "".join(out)


def split_bytes(ids: Sequence[int]) -> bytes:
    """The raw bytes among ``ids`` (specials skipped); file contents keep exact bytes."""
    return bytes(int(i) for i in ids if 0 <= int(i) < 256)

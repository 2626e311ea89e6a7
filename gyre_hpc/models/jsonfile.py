"""Reading a checkpoint folder's JSON files (config, index, tokenizer config) with errors that name the file."""
from __future__ import annotations

import json
from pathlib import Path


def read_json_object(path: Path, error: type[Exception]) -> dict:
    """The top-level object of ``path``; ``error`` names the file for a missing, malformed or non-object file."""
    if not path.is_file():
        raise error(f"{path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: top level must be an object, got {type(raw).__name__}")
    return raw

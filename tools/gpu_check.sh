#!/usr/bin/env bash
# The GPU checks, as one prepared run on the lent device machine (one H200). Here first:
#     bash tools/gpu_wheels.sh   (.whl/ is git-ignored)
# then through the device tool: command "bash tools/gpu_check.sh", carry [".whl"],
# timeout_s 480 (8 minutes). It prints the numbers of tools/gpu_check.py (control
# collectives, a 4-layer llama3-8b slice at 16k tokens extrapolated to the 8B layout, bucket
# packing GB/s, FP32 vs BF16-rounded head), chunked attention at Scout per-rank shapes
# (tools/bench_chunked_attention.py), then runs tests/test_gpu_paths.py (TE, vLLM and
# two-GPU tests skip there) and the train-step benchmark; logs to $OUT.
# CPU smoke mode (what CI runs): python tools/gpu_check.py --smoke
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 200 python3 tools/gpu_check.py 2>&1 | tee "$OUT/gpu_check.log"
if [ -f tools/bench_chunked_attention.py ]; then
    timeout 90 python3 tools/bench_chunked_attention.py --device cuda --scout 2>&1 | tee "$OUT/attention.log"
fi
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_paths.py 2>&1 | tee "$OUT/tests.log"
timeout 60 python3 tools/bench_train_step.py --dtype bfloat16 --preset tiny-llama 2>&1 | tee "$OUT/bench.log"

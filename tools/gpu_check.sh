#!/usr/bin/env bash
# The GPU checks, as one prepared run on the lent device machine (one H200). Here first:
#     bash tools/gpu_wheels.sh   (.whl/ is git-ignored)
# then through the device tool: command "bash tools/gpu_check.sh", carry [".whl"],
# timeout_s 420. It runs tests/test_gpu_paths.py (the trainer on megatron's DDP +
# distributed optimizer in BF16, its dist checkpoint, the pipeline schedule; TE, vLLM and
# two-GPU tests skip there) and the train-step benchmark, logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu_paths.py 2>&1 | tee "$OUT/tests.log"
python3 tools/bench_train_step.py --dtype bfloat16 --preset tiny-llama 2>&1 | tee "$OUT/bench.log"

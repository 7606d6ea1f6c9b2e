#!/usr/bin/env bash
# The GPU checks, as one prepared run on the lent device machine (one H200: CUDA torch,
# transformers and pytest; no vLLM, Transformer Engine or pytest-xdist). Here first:
#     bash tools/gpu_wheels.sh   (.whl/ is git-ignored: megatron-core, modelopt)
# then through the device tool: command "bash tools/gpu_check.sh", carry [".whl"],
# timeout_s 480 (BUDGET_S below; the steps' timeouts add up to less). It prints the numbers of
# tools/gpu_check.py (control collectives, a 4-layer llama3-8b slice at 16k tokens
# extrapolated to recipes/scalerl_8b.yaml's layout by megatron_rl/planning, bucket packing GB/s,
# FP32 vs BF16-rounded head), chunked attention at Scout per-rank shapes
# (tools/bench_chunked_attention.py), then runs tests/unit/models/test_gpu_paths.py (TE, vLLM and
# two-GPU tests skip there) and the train-step benchmark; logs to $OUT, one status line per
# step in $OUT/steps.txt; exit status 1 when a step failed.
#
# CPU smoke mode (no GPU; tiny sizes, the same steps):
#     PYTHON_VERSION=3.11 bash tools/gpu_wheels.sh
#     PYTHON=/path/to/venv/bin/python bash tools/gpu_check.sh --smoke
set -uo pipefail
BUDGET_S=480  # the device tool's timeout_s for this script (tests/unit/project/test_gpu_check.py checks it)
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
# The limits below are the GPU run's; a CPU smoke run (slow, shared cores) gets 4 times each.
LIMIT_SCALE=${LIMIT_SCALE:-$(( SMOKE ? 4 : 1 ))}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
SITE=${SITE:-/tmp/site}  # the carried wheels are installed here, first on PYTHONPATH
mkdir -p "$OUT"
: > "$OUT/steps.txt"
FAILED=0

step() {  # NAME TIMEOUT_S COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$(( $2 * LIMIT_SCALE )) start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$name rc=$rc seconds=$(( $(date +%s) - start )) limit=$limit" | tee -a "$OUT/steps.txt"
    [ "$rc" = 0 ] || FAILED=1
}

if compgen -G ".whl/*.whl" > /dev/null; then
    step install 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
if command -v nvidia-smi > /dev/null; then
    step gpu 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
# Versions, and any requirement of the carried wheels that the machine lacks (fails the step).
step versions 30 "$PY" -c '
import importlib.metadata as m, importlib.util as u, re, sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("transformers", "megatron-core", "nvidia-modelopt", "pytest"):
    print(name, m.version(name))
for name in ("xdist", "vllm", "transformer_engine"):
    print(name, "present" if u.find_spec(name) else "absent")
missing = set()
for dist in ("megatron-core", "nvidia-modelopt"):
    for req in m.requires(dist) or []:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if "extra ==" in req or "sys_platform" in req:
            continue
        try:
            m.version(name)
        except m.PackageNotFoundError:
            missing.add(name)
print("missing requirements:", ", ".join(sorted(missing)) or "none")
sys.exit(1 if missing else 0)
'
if [ "$SMOKE" = 1 ]; then
    step gpu_check 130 "$PY" tools/gpu_check.py --smoke
    step attention 60 "$PY" tools/bench_chunked_attention.py --device cpu --tokens 256 \
        --chunk 64 --repeats 1
else
    step gpu_check 130 "$PY" tools/gpu_check.py
    step attention 60 "$PY" tools/bench_chunked_attention.py --device cuda --scout
fi
# pyproject's addopts ask for pytest-xdist (-n 2 --dist loadgroup), which the check machine
# lacks: replace them and keep the plugin out even where it is installed.
step tests 120 "$PY" -m pytest -p no:xdist -o 'addopts=-ra' -q -p no:cacheprovider -rs \
    tests/unit/models/test_gpu_paths.py
if [ "$SMOKE" = 1 ]; then
    step bench 40 "$PY" tools/bench_train_step.py --dtype float32 --preset tiny-llama \
        --groups 2 --samples 4 --steps 2
else
    step bench 40 "$PY" tools/bench_train_step.py --dtype bfloat16 --preset tiny-llama
fi
echo "gpu_check.sh: $(grep -c ' rc=0 ' "$OUT/steps.txt") of $(wc -l < "$OUT/steps.txt") steps passed"
exit "$FAILED"

#!/usr/bin/env bash
# The GPU checks, as one prepared run on the lent device machine (one H200: CUDA torch,
# transformers and pytest; no vLLM, Transformer Engine or pytest-xdist). Here first:
#     bash tools/gpu_wheels.sh   (.whl/ is git-ignored: megatron-core, modelopt)
# then through the device tool: command "bash tools/gpu_check.sh", carry [".whl"],
# timeout_s 420. The window is 15 device minutes for all tries, the machine's start taking
# minutes of them: the script stops starting steps once BUDGET_S (390 s) is spent, each step
# has its own limit, and the steps run most-needed first, so one run plus the start stays
# under ~10 minutes and a rerun fits. Steps:
#   install, gpu, versions: the carried wheels, the GPU, versions and missing requirements;
#   tests: every GPU-only path on one GPU (pytest -m gpu; TE, vLLM and two-GPU tests skip):
#     tests/unit/models/test_gpu_paths.py (megatron models, optimizer, pipeline schedule),
#     tests/unit/models/test_fused_kernels_gpu.py (the fused kernels this machine loads),
#     tests/unit/platform/test_streams_gpu.py (a push's stream ordering: event, record_stream),
#     tests/unit/rollout/test_weight_push_fast.py (CUDA export, pinned host buffers),
#     tests/unit/trainer/test_async_checkpoint.py (async checkpoint of CUDA tensors),
#     tests/unit/rollout/test_fp8_rollouts.py (FP8 rollouts: the engines' FP8 quantizer on
#       CUDA, bit for bit against the CPU result that the CPU tests hold to vLLM's own
#       quantizers; its FP8 engine load-and-push test skips here, without vLLM, and
#       verifies both where a GPU has vLLM);
#     tests/unit/trainer/test_mismatch_gpu.py (the mismatch correction's weights, loss and
#       gradient on CUDA against float64 on the CPU; algorithm.mismatch_reference recompute
#       on a CUDA model: pi_old stored, the updates take it);
#   gpu_check: tools/gpu_check.py's numbers (control collectives, a 4-layer llama3-8b slice
#     at 16k tokens extrapolated to recipes/scalerl_8b.yaml's layout by megatron_rl/planning,
#     bucket packing GB/s, FP32 vs BF16-rounded head);
#   attention: chunked attention at Scout per-rank shapes (tools/bench_chunked_attention.py);
#   bench (only with --full, not in the window): the train-step benchmark.
# Logs to $OUT, one status line per step with its seconds in $OUT/steps.txt; exit status 1
# when a step failed or was skipped for the budget.
#
# CPU smoke mode (no GPU; tiny sizes, the same steps; the gpu tests skip):
#     PYTHON_VERSION=3.11 bash tools/gpu_wheels.sh
#     PYTHON=/path/to/venv/bin/python bash tools/gpu_check.sh --smoke
set -uo pipefail
BUDGET_S=390  # the whole run (tests/unit/project/test_gpu_check.py checks the steps fit it)
SMOKE=0
FULL=0
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=1 ;;
        --full) FULL=1 ;;
        *) echo "usage: gpu_check.sh [--smoke] [--full]" >&2; exit 2 ;;
    esac
done
# The limits below are the GPU run's; a CPU smoke run (slow, shared cores) gets 4 times each.
LIMIT_SCALE=${LIMIT_SCALE:-$(( SMOKE ? 4 : 1 ))}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
SITE=${SITE:-/tmp/site}  # the carried wheels are installed here, first on PYTHONPATH
mkdir -p "$OUT"
: > "$OUT/steps.txt"
FAILED=0
START=$(date +%s)

step() {  # NAME TIMEOUT_S COMMAND...: run with a time limit (within what is left of the
    # budget), log to $OUT/NAME.log, one line in $OUT/steps.txt
    local name=$1 limit=$(( $2 * LIMIT_SCALE )) left begin rc
    shift 2
    left=$(( BUDGET_S * LIMIT_SCALE - ($(date +%s) - START) ))
    if [ "$left" -lt 10 ]; then
        echo "$name skipped: budget of ${BUDGET_S}s spent" | tee -a "$OUT/steps.txt"
        FAILED=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    begin=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "$name rc=$rc seconds=$(( $(date +%s) - begin )) limit=$limit" | tee -a "$OUT/steps.txt"
    [ "$rc" = 0 ] || FAILED=1
}

if compgen -G ".whl/*.whl" > /dev/null; then
    step install 45 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
if command -v nvidia-smi > /dev/null; then
    step gpu 10 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi
# Versions, and any requirement of the carried wheels that the machine lacks (fails the step).
step versions 20 "$PY" -c '
import importlib.metadata as m, importlib.util as u, re, sys, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for name in ("transformers", "megatron-core", "nvidia-modelopt", "pytest"):
    print(name, m.version(name))
for name in ("xdist", "vllm", "transformer_engine", "triton"):
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
# pyproject's addopts ask for pytest-xdist (-n 2 --dist loadgroup), which the check machine
# lacks: replace them and keep the plugin out even where it is installed. --durations: the
# time of each test, for the next trim.
step tests 150 "$PY" -m pytest -p no:xdist -o 'addopts=-ra' -q -p no:cacheprovider -rs \
    --durations=15 -m gpu \
    tests/unit/models/test_gpu_paths.py tests/unit/models/test_fused_kernels_gpu.py \
    tests/unit/platform/test_streams_gpu.py tests/unit/rollout/test_weight_push_fast.py \
    tests/unit/trainer/test_async_checkpoint.py tests/unit/rollout/test_fp8_rollouts.py \
    tests/unit/trainer/test_mismatch_gpu.py
if [ "$SMOKE" = 1 ]; then
    step gpu_check 120 "$PY" tools/gpu_check.py --smoke
    step attention 45 "$PY" tools/bench_chunked_attention.py --device cpu --tokens 256 \
        --chunk 64 --repeats 1
else
    step gpu_check 120 "$PY" tools/gpu_check.py
    step attention 45 "$PY" tools/bench_chunked_attention.py --device cuda --scout
fi
if [ "$FULL" = 1 ]; then  # beyond the window's budget: run it when there is time to spare
    BUDGET_S=$(( BUDGET_S + 60 ))
    if [ "$SMOKE" = 1 ]; then
        step bench 40 "$PY" tools/bench_train_step.py --dtype float32 --preset tiny-llama \
            --groups 2 --samples 4 --steps 2
    else
        step bench 40 "$PY" tools/bench_train_step.py --dtype bfloat16 --preset tiny-llama
    fi
fi
echo "gpu_check.sh: $(grep -c ' rc=0 ' "$OUT/steps.txt") of $(wc -l < "$OUT/steps.txt") steps passed in $(( $(date +%s) - START )) s (budget ${BUDGET_S} s)"
exit "$FAILED"

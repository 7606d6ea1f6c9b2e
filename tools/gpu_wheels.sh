#!/usr/bin/env bash
# Wheels that the lent GPU machine lacks (its python3 3.12 has torch, transformers, pytest,
# but not megatron-core, modelopt and their few requirements), into .whl/ for the device
# tool's `carry` (about 24 MiB). vLLM and Transformer Engine are too large to carry: the
# checks in tools/gpu_check.sh skip what needs them. pytest-xdist is not carried: gpu_check.sh
# runs pytest with -p no:xdist and its own addopts. Run here, in the repository root:
#     bash tools/gpu_wheels.sh   (.whl/ is git-ignored)
# PYTHON_VERSION=3.11 fetches them for a 3.11 interpreter (the CPU smoke run of gpu_check.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl \
    megatron-core==0.16.1 nvidia-modelopt==0.47.0 omegaconf==2.4.0 \
    antlr4-python3-runtime==4.13.2 PuLP==3.3.2 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
du -sh .whl

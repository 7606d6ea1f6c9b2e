"""Shared fixtures: tiny HF models made locally (random init, fixed seed), never downloaded."""

from __future__ import annotations

import os

import pytest

from megatron_rl.platform.threads import set_omp_defaults  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
set_omp_defaults()  # what `megatron-rl` sets: before this process imports torch


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory):
    """{"tiny-llama": dir, "tiny-llama-tied": dir, "tiny-llama4": dir} of random HF models
    (seed 0)."""
    from megatron_rl.models import make_hf_model, preset_hf_config

    root = tmp_path_factory.mktemp("hf")
    return {
        name: make_hf_model(preset_hf_config(name), str(root / name), seed=0)
        for name in ("tiny-llama", "tiny-llama-tied", "tiny-llama4")
    }


def ensure_megatron_single_rank() -> None:
    """torch.distributed + megatron parallel state with one rank (TP=PP=EP=1) in this process,
    (re)initialised if a test before tore it down (in-process conversions do)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.platform import ParallelConfig, init_distributed

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        init_distributed(ParallelConfig())


@pytest.fixture
def megatron_single_rank():
    ensure_megatron_single_rank()
    yield


@pytest.fixture(scope="module")
def megatron_single_rank_module():
    """Module-scoped form, for module-scoped fixtures that build models."""
    ensure_megatron_single_rank()
    yield

"""Shared fixtures: tiny HF models made locally (random init, fixed seed), never downloaded."""

from __future__ import annotations

import os

import pytest

from megatron_rl.platform.threads import set_omp_defaults  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
set_omp_defaults()  # what `megatron-rl` sets: before this process imports torch


# Tests that share an expensive module-scoped fixture run on one xdist worker (``--dist
# loadgroup``), which builds it once: ppo_full_run is a 30 s training run, dense a vLLM engine
# and a megatron model (each was built on both workers: ~40 s of a 2-core machine's time).
SHARED_FIXTURES = ("ppo_full_run", "dense")


def pytest_itemcollected(item):
    """Marks as collected, before any ``pytest_collection_modifyitems`` (xdist's reads them)."""
    for name in SHARED_FIXTURES:
        if name in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}.{name}"))


def pytest_configure(config):
    """``--dist loadgroup`` needs pytest < 9.2 (setup.py): with 9.2, pytest-xdist 3.8.0 drops
    the groups silently (pytest-xdist issue 1386)."""
    from packaging.version import Version  # a dependency of pytest

    release = Version(pytest.__version__).release  # 9.2.0.dev340 and 9.2.0rc1 too: (9, 2, 0)
    if config.getoption("dist", "no") == "loadgroup" and release[:2] >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__}: pytest-xdist's --dist loadgroup would not group the "
            "tests (pytest-xdist issue 1386); install pytest < 9.2 (setup.py's dev extra)"
        )


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


@pytest.fixture(scope="session")
def llama31_tokenizer(tmp_path_factory):
    """Llama-3.1-8B-Instruct's real tokenizer (Meta's BPE file, the Hub's tokenizer_config.json
    with its chat template): ``tests/support/real_tokenizers.py``. Built once per session."""
    from support.real_tokenizers import build_llama31_tokenizer

    return build_llama31_tokenizer(tmp_path_factory.mktemp("llama31_tokenizer"))


@pytest.fixture(scope="session")
def llama4_tokenizer(tmp_path_factory):
    """Llama-4's real tokenizer (Meta's BPE file and special tokens, the Hub's chat template):
    ``tests/support/real_tokenizers.py``. Built once per session."""
    from support.real_tokenizers import build_llama4_tokenizer

    return build_llama4_tokenizer(tmp_path_factory.mktemp("llama4_tokenizer"))

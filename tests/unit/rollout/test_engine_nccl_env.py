"""The engines' NCCL settings (issue 36, 11): the same as the trainer's on the communicators
they share, the engines' own NVLS choice pinned by vLLM for their own communicators only, and
no Megatron-only CUDA_DEVICE_MAX_CONNECTIONS."""

from __future__ import annotations

import logging
import os

import pytest
from vllm.utils import nccl as vllm_nccl

from megatron_rl.rollout.engine import nccl_env


def test_an_engine_process_drops_the_trainers_cuda_device_max_connections():
    environ = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_CUMEM_ENABLE": "1"}
    nccl_env.drop_trainer_only_vars(environ)
    assert environ == {"NCCL_CUMEM_ENABLE": "1"}


def test_the_engines_nvls_variable_is_read_strictly():
    assert nccl_env.engine_nccl_pins({}) == {}
    assert nccl_env.engine_nccl_pins({nccl_env.ENGINE_NVLS_ENV: "0"}) == {"NCCL_NVLS_ENABLE": "0"}
    with pytest.raises(ValueError, match=nccl_env.ENGINE_NVLS_ENV):
        nccl_env.engine_nccl_pins({nccl_env.ENGINE_NVLS_ENV: "off"})


@pytest.fixture
def launch_env(monkeypatch):
    """A job that left NVLS to NCCL (no NCCL_NVLS_ENABLE), vLLM's pin state fresh; every
    variable touched is restored afterwards."""
    for name in ("NCCL_NVLS_ENABLE", "NCCL_NO_CACHE", nccl_env.LAUNCH_VALUES_ENV):
        monkeypatch.setenv(name, "")  # so that monkeypatch restores it (unset) afterwards
        monkeypatch.delenv(name)
    monkeypatch.setenv(nccl_env.ENGINE_NVLS_ENV, "0")
    monkeypatch.setattr(vllm_nccl, "_unpinned_env", None)


def test_the_engines_nvls_is_pinned_off_their_shared_communicators(monkeypatch, launch_env):
    """Our general plugin (run by vLLM in every process it starts) pins NVLS off for the
    engine's own communicators through vLLM's ``pin_nccl_env``; vLLM's weight-transfer
    communicators are made under ``unpinned_nccl_env``, where the variable is the job's
    again (here unset, as in the trainer's step)."""
    from megatron_rl.rollout.weights.cpu_backend import register_backend

    monkeypatch.setattr(vllm_nccl, "_nccl_has_no_cache", lambda: True)  # NCCL >= 2.29.7
    register_backend()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert "NCCL_NVLS_ENABLE" in os.environ["NCCL_NO_CACHE"].split(",")
    with vllm_nccl.unpinned_nccl_env():  # how nccl_common makes the shared communicators
        assert "NCCL_NVLS_ENABLE" not in os.environ
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_engine_processes_started_by_a_pinned_one_keep_the_jobs_nvls_on_shared_ones(
    monkeypatch, launch_env
):
    """vLLM loads the plugin in the generator's process and the engine core, then starts the
    workers from them: a worker inherits the pinned NCCL_NVLS_ENABLE=0. Its own pin must still
    leave the job's setting (unset) to the communicators it shares with the trainer."""
    from megatron_rl.rollout.weights.cpu_backend import register_backend

    monkeypatch.setattr(vllm_nccl, "_nccl_has_no_cache", lambda: True)
    register_backend()  # the parent (API server / engine core)
    monkeypatch.setattr(vllm_nccl, "_unpinned_env", None)  # a child: environment inherited
    register_backend()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    with vllm_nccl.unpinned_nccl_env():
        assert "NCCL_NVLS_ENABLE" not in os.environ
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_without_per_communicator_settings_the_engines_keep_the_jobs(
    monkeypatch, launch_env, caplog
):
    """NCCL < 2.29.7 cannot keep a pin off the shared communicators: no pin (the engines'
    settings stay the trainer's), and a warning says so."""
    monkeypatch.setattr(vllm_nccl, "_nccl_has_no_cache", lambda: False)
    with caplog.at_level(logging.WARNING, logger=nccl_env.__name__):
        assert nccl_env.pin_engine_nccl_env() == {}
    assert "NCCL_NVLS_ENABLE" not in os.environ
    assert "NCCL < 2.29.7" in caplog.text

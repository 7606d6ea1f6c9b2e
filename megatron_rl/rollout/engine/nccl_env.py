"""NCCL settings of the vLLM engines: the same as the trainer's wherever they share a
communicator.

The trainer's weight sender and the engines' workers form one NCCL communicator (the
``nccl`` broadcast groups, ``nccl_m2n``'s communicators). NCCL never reconciles its
``NCCL_*`` settings across the ranks of a communicator: a rank with NVLS (``NCCL_NVLS_ENABLE``)
and one without can hang in its first collective (vLLM 0.32 warns of exactly that,
``vllm/utils/nccl.py``). So both Slurm steps get one NCCL environment (the job's exports in
the sbatch script); what only the engines want for their own tensor-parallel communicators
(NVLS off by default, ``cluster.engine_nccl_nvls``: its buffers take engine memory) goes to
them as :data:`ENGINE_NVLS_ENV`, a variable NCCL does not read, which every engine process
turns into a vLLM *pin* (``vllm.utils.nccl.pin_nccl_env``). vLLM creates its weight-transfer
communicators without the pins (``nccl_common.stateless_init_process_group`` runs under
``unpinned_nccl_env``), so there the engines keep the trainer's settings.

Pins need NCCL >= 2.29.7 (``NCCL_NO_CACHE``, which lets NCCL re-read a variable per
communicator); with an older NCCL a pin would apply to the shared communicators too, so the
engines then run with the job's setting (and say so).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

ENGINE_NVLS_ENV = "MEGATRON_RL_ENGINE_NCCL_NVLS"  # "0" / "1": the engines' own NVLS
# What the trainer's step sets for Megatron alone: one hardware queue per GPU, which orders
# Megatron's TP/SP communication before the compute that depends on it. An engine process
# (one started by the trainer inherits its environment) drops it before CUDA starts: it would
# serialise vLLM's streams (the weight receive behind the decode kernels).
TRAINER_ONLY_VARS = ("CUDA_DEVICE_MAX_CONNECTIONS",)
# The job's values of the pinned variables (JSON; null: unset), written by the first process of
# an engine that pins. vLLM loads our plugin in the generator's process and in the engine core
# before it starts the workers, and a child inherits the pinned environment: pinning again
# there, vLLM would record the pinned value as the launch one and make the communicators
# shared with the trainer with it (vLLM 0.32 pins its own settings in the worker alone).
LAUNCH_VALUES_ENV = "MEGATRON_RL_ENGINE_NCCL_LAUNCH_VALUES"


def drop_trainer_only_vars(environ: MutableMapping[str, str] = os.environ) -> None:
    """At an engine process's start: remove :data:`TRAINER_ONLY_VARS`."""
    for name in TRAINER_ONLY_VARS:
        environ.pop(name, None)


def engine_nccl_pins(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The NCCL variables this engine process sets for its own communicators only."""
    value = environ.get(ENGINE_NVLS_ENV)
    if value is None:
        return {}
    if value not in ("0", "1"):
        raise ValueError(f"{ENGINE_NVLS_ENV}={value!r}: expected 0 or 1")
    return {"NCCL_NVLS_ENABLE": value}


def pin_engine_nccl_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Pin :func:`engine_nccl_pins` for this process's own communicators (vLLM runs our
    general plugin, which calls this, in every process it starts, before a worker's first
    NCCL call; only an engine's step sets :data:`ENGINE_NVLS_ENV`). Returns what was pinned."""
    pins = engine_nccl_pins(environ)
    if not pins:
        return {}
    from vllm.utils import nccl as vllm_nccl

    # vLLM 0.32 decides this with the same private check inside pin_nccl_env; asked first,
    # because a pin it cannot keep off the shared communicators would split their settings.
    if not vllm_nccl._nccl_has_no_cache():
        logger.warning(
            "%s=%s not applied: NCCL < 2.29.7 (no NCCL_NO_CACHE) would apply it to the "
            "communicators shared with the trainer too; the engines keep the job's NCCL "
            "settings (megatron-rl plan counts engine NVLS buffers only with "
            "cluster.engine_nccl_nvls)",
            ENGINE_NVLS_ENV,
            pins["NCCL_NVLS_ENABLE"],
        )
        return {}
    saved = environ.get(LAUNCH_VALUES_ENV)
    if saved is None:
        environ[LAUNCH_VALUES_ENV] = json.dumps({name: environ.get(name) for name in pins})
    else:  # a child of a process that pinned: the job's values first, then the pins
        for name, value in json.loads(saved).items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
    vllm_nccl.pin_nccl_env(pins)
    return pins

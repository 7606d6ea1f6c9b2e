"""Megatron-Core on a machine without CUDA: the only place that patches upstream for CPU.

Installed once by :func:`megatron_rl.platform.setup_platform` when no GPU is present, never
on GPU. Each fix names the upstream code it works around (megatron-core 0.16.1):

1. megatron calls a handful of ``torch.cuda`` functions unconditionally (``current_device``
   for buffer placement, streams/events around communication, ``synchronize``). On CPU they
   become harmless stand-ins: device index 0 maps to the CPU via the patched
   ``current_device``, streams and events are no-ops.
2. ``moe_utils.te_general_gemm`` is only defined when Transformer Engine imports, but the
   router's ``RouterGatingLinearFunction`` reads it unconditionally -> ``NameError``.
3. megatron's RNG tracker (``tensor_parallel.random``) forks the CUDA generator for
   per-TP-rank dropout/init streams; on CPU it forks the CPU generator instead.
4. The alltoall MoE dispatcher calls ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which
   only converts CUDA tensors; CPU split sizes stay tensors and gloo's ``all_to_all_single``
   rejects them. The fix converts CPU tensors too when numpy is asked for.
5. The optimizer, grad-norm, grad-scaler and schedule code allocates small tensors with a
   ``device='cuda'`` literal (``optimizer.optimizer``, ``optimizer.clip_grads``,
   ``optimizer.grad_scaler``, ``pipeline_parallel.schedules``, ``utils``). Those modules see
   a ``torch`` whose factory functions place 'cuda' tensors on the CPU; everything else in
   them is the real ``torch``.
6. ``clip_grads.clip_grad_by_total_norm_fp32`` asserts ``grad.type() == 'torch.cuda.
   FloatTensor'``; the optimizers get the same scaling without the CUDA type check.
   (Float16OptimizerWithFloat16Params and DistributedOptimizer check ``param.type()``
   against CUDA type names too: on CPU the trainer uses fp32 parameters and the plain
   optimizer, see ``megatron_rl.trainer.optim``.)
"""

from __future__ import annotations

import contextlib
import logging
import types

import torch

logger = logging.getLogger(__name__)
_INSTALLED = False


class _NullStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: work is synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def record_event(self, *args, **kwargs) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _NullEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _NullEvent) -> float:
        return 0.0


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"  # megatron passes it as ``device=``
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda *a, **k: _NullStream()
    cuda.default_stream = lambda *a, **k: _NullStream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.synchronize = lambda *a, **k: None


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # (torch.manual_seed itself calls torch.cuda.manual_seed_all: leave that one alone.)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")
_CUDA_LITERAL_MODULES = (
    "megatron.core.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.pipeline_parallel.schedules",
)


class _CpuFactoryTorch(types.ModuleType):
    """``torch`` as the modules above see it: 'cuda' in a factory's ``device=`` means CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, self._on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def _on_cpu(factory):
        def make(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
                kwargs.pop("pin_memory", None)  # needs CUDA
            return factory(*args, device=device, **kwargs)

        return make


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """``clip_grads.clip_grad_by_total_norm_fp32`` without its CUDA tensor-type assertion."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_device_literals() -> None:
    import importlib

    cpu_torch = _CpuFactoryTorch()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = cpu_torch
    from megatron.core.optimizer import optimizer

    optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32


def _patch_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__

    def __new__(cls, config, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # only for the assertion
        try:
            norm = original(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = __new__


def install() -> None:
    """Install the CPU fixes (idempotent). Call only on a machine without CUDA."""
    global _INSTALLED
    if _INSTALLED:
        return
    assert not torch.cuda.is_available(), "cpu_compat must not be installed on a GPU machine"
    _patch_torch_cuda()
    _patch_rng()
    _patch_moe()
    _patch_device_literals()
    _patch_norm_sequence_parallel()
    _INSTALLED = True
    logger.debug("megatron-core CPU compatibility layer installed")

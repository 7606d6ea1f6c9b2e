"""Which accelerator this process runs on: decided once, here, for the whole package."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from megatron_rl.platform.kernels import FusedKernels, detect_fused_kernels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Platform:
    """The compute platform of this process.

    ``device``: "cuda" or "cpu"; ``backend``: torch.distributed backend ("nccl" or "gloo");
    ``transformer_engine``: whether Transformer Engine layer specs (BF16/FP8) are usable;
    ``kernels``: the fused kernels megatron-core can use here (none on CPU).
    """

    device: str
    backend: str
    transformer_engine: bool
    transformer_engine_error: str | None = None  # why TE failed to import on a GPU
    kernels: FusedKernels = FusedKernels()

    @property
    def is_gpu(self) -> bool:
        return self.device == "cuda"

    def torch_device(self) -> torch.device:
        if self.is_gpu:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _transformer_engine_error() -> str | None:
    """None when Transformer Engine imports, else why not (not installed, or installed but
    broken: built for another CUDA or torch). Never swallowed silently: a GPU model that
    asks for TE layer specs fails with this message (``models.provider.build_model``)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or an OSError / RuntimeError from its libraries
        return f"{type(err).__name__}: {err}"
    return None


@functools.lru_cache(maxsize=1)
def get_platform() -> Platform:
    """Detect the platform once; on a machine without CUDA install the CPU fixes."""
    if torch.cuda.is_available():
        error = _transformer_engine_error()
        platform = Platform("cuda", "nccl", error is None, error, detect_fused_kernels())
        if error is not None:
            logger.warning("Transformer Engine does not import on this GPU machine: %s", error)
    else:
        from megatron_rl.platform import cpu_compat

        cpu_compat.install()
        platform = Platform("cpu", "gloo", False)
    logger.info("platform: %s", platform)
    return platform


def set_thread_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's current device. CUDA's current device belongs to
    the thread: a helper thread starts on GPU 0 whatever the main thread chose, and NCCL
    communicators (vLLM's PyNccl) are made on, and assert, the current device. No-op on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def current_stream() -> torch.cuda.Stream | None:
    """The calling thread's current CUDA stream, for a library that is handed one (vLLM's
    ``nccl.m2n`` reshard); None on CPU, where nothing runs asynchronously. (On CPU,
    ``torch.cuda.current_stream`` raises, or returns the placeholder that importing vLLM's
    CPU worker installs process-wide: never one to hand anything.)"""
    return torch.cuda.current_stream() if get_platform().is_gpu else None


def record_event() -> torch.cuda.Event | None:
    """An event marking the work enqueued so far on the calling thread's current CUDA stream:
    a consumer on another stream (another thread's, or a library's side stream) waits on it
    with :func:`wait_event` before it reads what that work produced. None on CPU, where
    nothing runs asynchronously."""
    if not get_platform().is_gpu:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return event


def wait_event(event: torch.cuda.Event | None) -> None:
    """Make the calling thread's current CUDA stream wait (on the device: the host goes on)
    for ``event`` (:func:`record_event`); None: nothing to wait for."""
    if event is not None:
        torch.cuda.current_stream().wait_event(event)


def keep_for_stream(tensor: torch.Tensor) -> None:
    """Tell the caching allocator that the calling thread's current CUDA stream reads
    ``tensor`` (``record_stream``): if its last reference goes while that stream's work is
    still queued, its memory is not handed to another stream's allocation before that work
    is done. Needed when the stream is not the one ``tensor`` was allocated on. No-op on CPU."""
    if get_platform().is_gpu:
        tensor.record_stream(torch.cuda.current_stream())


def host_buffer(nbytes: int, shared: bool = False) -> torch.Tensor:
    """A flat uint8 host buffer of ``nbytes`` for data that must pass through host memory
    (weight buckets to engines in other processes or on other hosts). ``shared``: in shared
    memory, sendable to another process through ``torch.multiprocessing`` (as a file
    descriptor, no copy). On a GPU machine the buffer is pinned (page-locked: device copies
    into it run at the link's speed, asynchronously); on a CPU machine it is plain memory.
    Pinned shared memory stays registered with CUDA as long as the returned tensor lives."""
    if not shared:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=get_platform().is_gpu)
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)[:nbytes]
    if get_platform().is_gpu and nbytes:
        import weakref

        cudart = torch.cuda.cudart()
        pointer = buffer.data_ptr()
        error = cudart.cudaHostRegister(pointer, nbytes, 1)  # portable
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte shared buffer: error {error}")
        weakref.finalize(buffer, cudart.cudaHostUnregister, pointer)
    return buffer


def local_device_count() -> int | None:
    """GPUs on this node, for tools that start one local rank per GPU; None on CPU, where
    local ranks share the cores and any number fits."""
    return torch.cuda.device_count() if get_platform().is_gpu else None

"""Weight transport into vLLM engines on CPU: a backend of vLLM's weight-transfer registry.

vLLM 0.32 ships weight-transfer engines for GPUs (``nccl``, CUDA ``ipc`` ...) behind
``WeightTransferEngineFactory``; none works without CUDA. We register ``megatron_rl_cpu``:
the worker side receives buckets of HF-named tensors and loads them through vLLM's
layerwise reload (``start_weight_update`` -> ``update_weights`` per bucket ->
``finish_weight_update``), exactly like the CUDA ``ipc`` backend. A bucket arrives either as
the trainer's own tensors (engine in the same process: no copy) or as one flat shared-memory
buffer plus a layout (engine in another process: one copy, shared by every engine).

Three vLLM 0.32 problems are handled here. Rotary embeddings, shared by the engines of one
process, are kept out of the reload (see :func:`keep_shared_modules_out_of_reload`). And two
CPU bugs where a layer's GEMM runs on a packed copy made at first load that the reload never
refreshes, so the engine samples from stale weights:

- fused-MoE expert weights are not re-prepacked (with ``is_weight_update`` the unquantized
  MoE method skips ``fused_experts.process_weights_after_loading``): garbage MoE outputs;
- a tied ``lm_head`` (``tie_word_embeddings``: Llama-3.2-1B/3B) shares the embedding's
  parameter, which the reload updates in place, but it is never loaded itself (the checkpoint
  has no ``lm_head.weight``), so its packed GEMM handle (``cpu_linear``, oneDNN / sgl) keeps
  the weights of the first load: log-probs off by ~0.1 nats after a push.

``finish_weight_update`` re-runs the packing for both (:func:`repack_cpu_stale_layers`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from megatron_rl.rollout.weights.buckets import CPU_BACKEND, unpack_views
from megatron_rl.rollout.weights.experts import fix_cpu_moe_expert_map, own_part

logger = logging.getLogger(__name__)

BACKEND = CPU_BACKEND
NCCL_EP_BACKEND = (
    "megatron_rl_nccl_ep"  # GPU, expert-parallel engines: megatron_rl.rollout.weights.nccl
)


@dataclass
class CpuTransferInitInfo(WeightTransferInitInfo):
    """No rendezvous: buckets arrive with each update."""


@dataclass
class CpuTransferUpdateInfo(WeightTransferUpdateInfo):
    """One bucket: ``names`` with either ``tensors`` or a flat uint8 ``buffer`` holding
    tensor i at byte ``offsets[i]`` with ``dtype_names[i]`` and ``shapes[i]``."""

    names: list[str]
    tensors: list[torch.Tensor] | None = None
    buffer: torch.Tensor | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None
    offsets: list[int] | None = None

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        if self.tensors is not None:
            assert len(self.tensors) == len(self.names)
            return list(zip(self.names, self.tensors))
        assert self.buffer is not None and self.offsets is not None
        return list(
            zip(self.names, unpack_views(self.buffer, self.dtype_names, self.shapes, self.offsets))
        )


class CpuWeightTransferEngine(WeightTransferEngine[CpuTransferInitInfo, CpuTransferUpdateInfo]):
    """Worker side of the ``megatron_rl_cpu`` backend (checkpoint-format, layerwise reload)."""

    init_info_cls = CpuTransferInitInfo
    update_info_cls = CpuTransferUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: CpuTransferInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        keep_shared_modules_out_of_reload(self.model)
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises without one.
        # An expert-parallel engine's update has a part per rank: this rank's experts.
        update_info = own_part(update_info, self.model)
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: CpuTransferUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )

        with disable_mtp_completeness_check():
            self.model.load_weights(update_info.weights())

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_stale_layers(self.model)

    def shutdown(self) -> None:
        pass


def repack_cpu_stale_layers(model: torch.nn.Module) -> int:
    """Re-run the CPU weight packing that vLLM 0.32's reload skips (see the module docstring):
    every fused-MoE layer, and every layer whose weight is a parameter shared with another
    layer (a tied ``lm_head``). Returns the number of layers repacked.
    """
    count = 0
    sharers: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)
            count += 1
        elif (weight := module._parameters.get("weight")) is not None:
            sharers.setdefault(id(weight), []).append(module)
    for modules in sharers.values():
        for module in modules if len(modules) > 1 else ():
            if hasattr(module, "cpu_linear"):  # re-pack its GEMM from the current weight
                module.quant_method.process_weights_after_loading(module)
                count += 1
    return count


def keep_shared_modules_out_of_reload(model: torch.nn.Module) -> None:
    """Exclude rotary embeddings from vLLM's layerwise reload (for good: idempotent).

    vLLM caches RotaryEmbedding modules process-wide (``get_rope``'s ``_ROPE_DICT``), so the
    engines of one process share them. The reload moves every module's tensors to the meta
    device until the update finishes, so another engine stepping meanwhile would fail ("Cannot
    copy out of meta tensor"). They hold no weights (only a cos/sin cache): nothing to reload.
    """
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.model_executor.model_loader.reload import meta

    for module in model.modules():
        if isinstance(module, RotaryEmbeddingBase) and not list(module.parameters(recurse=False)):
            meta.SKIP_MODULES.add(type(module).__name__)


def register_backend() -> None:
    """Register ``megatron_rl_cpu`` with vLLM's WeightTransferEngineFactory (idempotent).
    vLLM runs this (our general plugin) in every process it starts: the CPU MoE kernel's
    expert-parallel fix goes there too, and the engines' own NCCL settings (before the
    worker's first NCCL call: :mod:`megatron_rl.rollout.engine.nccl_env`)."""
    from megatron_rl.rollout.engine.nccl_env import pin_engine_nccl_env

    pin_engine_nccl_env()
    fix_cpu_moe_expert_map()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, CpuWeightTransferEngine)
    if NCCL_EP_BACKEND not in WeightTransferEngineFactory._registry:  # loaded when used
        WeightTransferEngineFactory.register_engine(
            NCCL_EP_BACKEND, "megatron_rl.rollout.weights.nccl", "ExpertParallelNcclEngine"
        )

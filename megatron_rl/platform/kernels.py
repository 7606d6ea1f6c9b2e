"""Which of megatron-core's fused kernels this GPU machine can run (all off on CPU).

megatron-core 0.16.1 leaves every fusion to the caller, and a fusion asked for without its
library fails late (at model construction or in the first forward). What each needs:

- ``gradient_accumulation_fusion``: weight gradients accumulated into megatron DDP's fp32
  ``main_grad`` inside the GEMM. Transformer Engine's linears do it natively, but
  ``GPTModel``'s output layer is always megatron's own ``ColumnParallelLinear``, whose
  constructor raises unless apex's ``fused_weight_gradient_mlp_cuda`` extension imports
  (``tensor_parallel/layers.py``): so megatron's own flag for that import decides
  (``layers._grad_accum_fusion_available``, set by its ``try: import ... except ImportError``).
  Finding the extension is not enough: after vLLM's install replaces torch, apex's kernels
  are still found but fail to import (undefined symbols). Models built with it must be
  trained inside megatron's ``DistributedDataParallel`` (which gives every weight its
  ``main_grad``), as the trainer does (``trainer.optim.wrap_model``).
- ``apply_rope_fusion``: Transformer Engine's fused RoPE, which megatron imports as
  ``rope_utils.fused_apply_rotary_pos_emb``; interleaved RoPE (Llama-4) stays unfused:
  megatron-core 0.16.1 drops ``interleaved`` on packed (THD) micro-batches (see ``_te_rope``).
- ``bias_activation_fusion``: megatron's SwiGLU fusion (``fusions/fused_bias_swiglu.py``),
  compiled by ``torch.compile`` (``megatron.core.jit.jit_fuser``): Triton on CUDA, which
  builds its launcher with the machine's C compiler (``triton/runtime/build.py``).
- ``masked_softmax_fusion``: the softmax of megatron's local ``DotProductAttention``, through
  apex's ``scaled_masked_softmax_cuda`` / ``scaled_upper_triang_masked_softmax_cuda``
  (imported at the first forward). Our layer specs never use that attention (TE's, or torch
  SDPA in ``models.attention``), so it changes nothing today; it is set where it would work.

``moe_grouped_gemm`` is not here: modelopt 0.47 imports Llama-4's packed experts only into
``SequentialMLP.local_experts`` (``megatron_importer.py``, ``local_experts.linear_fc1_ep``),
and the weight stream, parity check and checkpoints expect that module (see models/arch.py).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import shutil
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FusedKernels:
    """The fusions a GPU model may ask megatron-core for; the default (all False) is the CPU's."""

    gradient_accumulation_fusion: bool = False
    apply_rope_fusion: bool = False
    interleaved_rope_fusion: bool = False  # apply_rope_fusion with rotary_interleaved
    bias_activation_fusion: bool = False
    masked_softmax_fusion: bool = False

    def transformer_config_options(self, rotary_interleaved: bool) -> dict[str, bool]:
        """megatron-core ``TransformerConfig`` options for a model whose RoPE is interleaved
        (``rotary_interleaved``) or not."""
        rope = self.interleaved_rope_fusion if rotary_interleaved else self.apply_rope_fusion
        return {
            "gradient_accumulation_fusion": self.gradient_accumulation_fusion,
            "apply_rope_fusion": rope,
            "bias_activation_fusion": self.bias_activation_fusion,
            "masked_softmax_fusion": self.masked_softmax_fusion,
        }


def _imports(module: str) -> bool:
    """Whether ``module`` imports here (imported, not merely found: a compiled extension
    built against another torch is found and then fails to load)."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError:
        return False
    except Exception as err:  # found but broken: ImportError (symbols), OSError (a library)
        logger.warning("%s is installed but does not import: %s: %s", module,
                       type(err).__name__, err)  # fmt: skip
        return False
    return True


def _grad_accum_fusion() -> bool:
    """megatron-core's own answer: ``ColumnParallelLinear`` raises when
    ``gradient_accumulation_fusion`` is asked for and this flag (its import of
    ``fused_weight_gradient_mlp_cuda`` at module load) is False."""
    from megatron.core.tensor_parallel import layers

    return bool(layers._grad_accum_fusion_available)


def _c_compiler() -> bool:
    """Triton's own search for a C compiler (``triton/runtime/build.py``)."""
    return any((os.environ.get("CC"), shutil.which("clang"), shutil.which("gcc")))


def _te_rope() -> tuple[bool, bool]:
    """(fused RoPE, fused interleaved RoPE), by megatron's own checks."""
    try:
        from megatron.core.models.common.embeddings.rope_utils import (
            fused_apply_rotary_pos_emb,
        )

        if fused_apply_rotary_pos_emb is None:
            return False, False
        # Interleaved (Llama-4) stays unfused: megatron-core 0.16.1's apply_rotary_pos_emb
        # (rope_utils.py) hands a packed (THD, cu_seqlens) micro-batch, the GPU default
        # (batch.pack), to fused_apply_rotary_pos_emb_thd without ``interleaved`` (that
        # function takes none: extensions/transformer_engine.py), so TE would rotate halves
        # where Llama-4 rotates pairs. Its unfused THD path passes rotary_interleaved.
        # Turn it on (with TE >= 2.3: is_te_min_version) once megatron passes the flag there.
        return True, False
    except Exception as err:  # a TE that imports but is broken: no fusion, say why
        logger.warning("fused RoPE unavailable: %s: %s", type(err).__name__, err)
        return False, False


@functools.lru_cache(maxsize=1)
def detect_fused_kernels() -> FusedKernels:
    """The fusions available on this GPU machine (call on GPU only: ``get_platform``)."""
    rope, interleaved = _te_rope()
    kernels = FusedKernels(
        gradient_accumulation_fusion=_grad_accum_fusion(),
        apply_rope_fusion=rope,
        interleaved_rope_fusion=interleaved,
        bias_activation_fusion=_imports("triton") and _c_compiler(),
        masked_softmax_fusion=_imports("scaled_masked_softmax_cuda")
        and _imports("scaled_upper_triang_masked_softmax_cuda"),
    )
    logger.info("fused kernels: %s", kernels)
    return kernels

"""FP8 rollouts (``rollout.quantization``): what the engines run, and what a push quantizes.

Decision: the trainer pushes its weights unquantized (the model dtype, checkpoint format, as
without FP8) and every engine quantizes them on load through vLLM's own online-quantization
path. The alternative, FP8 weights plus scales from the trainer (half the bytes on the wire),
is not taken, for these reasons (vLLM 0.32.0, paths under ``vllm/``):

- The engines are started from the trainer's HF export, which is not an FP8 checkpoint. vLLM
  0.32's ``fp8`` method is for FP8-serialized checkpoints: ``Fp8Config.__init__``
  refuses online quantization and points to ``fp8_per_tensor``
  (model_executor/layers/quantization/fp8.py:106-112); ``quantization="fp8"`` on an
  unquantized checkpoint survives only as a deprecated alias of ``fp8_per_tensor``
  (model_executor/model_loader/weight_utils.py:351-358), so we name the shorthand itself. Online FP8 is
  ``OnlineQuantizationConfig`` with the shorthands ``fp8_per_tensor`` / ``fp8_per_block``
  (config/quantization.py:192-200; model_executor/layers/quantization/online/base.py).
- Those online methods create the layer's weight in the model dtype on the meta device and
  wrap its loaders (online/fp8.py:170-188, ``initialize_online_processing``); vLLM records
  that "model format" for reloads right after construction (model_executor/model_loader/
  utils.py:96 ``record_metadata_for_reloading``). A reload therefore expects checkpoint-format
  (unquantized) tensors: an FP8 tensor or a ``weight_scale`` name has no parameter to load
  into (the failure verl hit sending FP8 into vLLM's ``load_weights``: verl issue 6112;
  vLLM issue 17272 is the same mismatch without layerwise reload).
- Every weight transport we use loads through vLLM's layerwise reload: ``nccl``
  (distributed/weight_transfer/nccl_engine.py:159-173), ``nccl_m2n`` with a quantized
  engine (distributed/weight_transfer/m2n_engine.py:338-348; its direct resharding into
  live parameters is for unquantized engines only, m2n_engine.py:249-256, so every
  parameter then arrives whole and goes through ``load_weights``) and our host backend
  (``rollout.weights.cpu_backend``). ``initialize_layerwise_reload`` puts each layer back in
  model format on meta (model_executor/model_loader/reload/layerwise.py:83-117); when a
  layer's tensors have all arrived, ``_layerwise_process`` materialises it, loads them, clears
  the ``_already_called_process_weights_after_loading`` latch (layerwise.py:356-359: without
  that, online FP8's ``process_weights_after_loading`` runs once per engine life, online/fp8.py
  :253-273) and re-runs the quantizer, then copies the result into the kernel tensors the
  engine (and its CUDA graphs) already hold (layerwise.py:395-398). This is vLLM's
  RL reload design (vLLM PR 32133 "[QeRL] Layerwise Reloading", PR 38032 "[QeRL] Compose
  online quantization with quantized reloading").
- Per-tensor scales of fused and TP-sharded layers need the whole layer: vLLM takes the amax
  over the fused qkv / gate_up rows and all-reduces it over the TP group
  (online/fp8.py:258-261, ``amax_for_tp_weight_quant``). A trainer-side quantizer would have
  to reproduce the engine's fusion, sharding and, on Blackwell, DeepGEMM's scale layout
  (the UE8M0 requantisation that broke reloads in SGLang PR 30761) for every model.

What it costs: the push moves the model dtype's bytes (no saving on the wire), and each
engine GPU holds one layer's unquantized copy while that layer is quantized (layerwise
reload's materialised layer, plus the quantizer's float32 intermediate): counted by the
planner (``planning.engine``).

Variants (``rollout.quantization``): ``fp8`` = vLLM ``fp8_per_tensor`` (one float32 scale per
linear layer, dynamic activation scales); ``fp8_block`` = vLLM ``fp8_per_block`` (a float32
scale per 128 x 128 weight block, ``weight_scale_inv``; activations per 1 x 128 group: the
DeepSeek-style recipe, run by DeepGEMM / CUTLASS block kernels on Hopper and Blackwell).
Embeddings, the LM head, norms and MoE routers stay in the model dtype (vLLM quantizes
``LinearBase`` layers and routed experts only: online/base.py ``resolve_quant_method_cls``;
Llama-4's router is a ``LinearBase``, ``GateLinear``, but built without the quantization
config, models/llama4.py:101-105, so it gets vLLM's unquantized method).

:func:`quantize_fp8` is what vLLM's quantizer makes of one linear layer at a push (before the
GEMM kernel's own repacking: on Blackwell, DeepGEMM re-expresses block scales as UE8M0 powers of
two, ``deepgemm_post_process_fp8_weight_block``, model_executor/kernels/linear/scaled_mm/
deep_gemm.py:84-99; layerwise reload re-runs that too, into tensors of the shape the first load
made, so the reload failures SGLang had with repacked scales do not arise); the tests check
it against vLLM's own quantizers on CPU (``per_block_cast_to_fp8``, utils/deep_gemm.py:984;
``QuantFP8.forward_native``, the torch form of ``_custom_ops.scaled_fp8_quant``'s static
per-tensor kernel, which vLLM's CPU build does not have) and ``tools/gpu_check.sh`` on CUDA.
FP8 kernels need a GPU of compute capability >= 8.9 (:func:`quantization_problem`); vLLM's
CPU build runs none on machines without AMX-FP8 and has no static FP8 quant op at all, so a
CPU engine refuses ``rollout.quantization``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# rollout.quantization -> vLLM's ``quantization`` (EngineArgs) for it.
VLLM_QUANTIZATION: dict[str, str] = {"fp8": "fp8_per_tensor", "fp8_block": "fp8_per_block"}
QUANTIZATIONS: tuple[str, ...] = tuple(VLLM_QUANTIZATION)
# FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x). Below, vLLM would fall back to
# Marlin weight-only FP8 (model_executor/kernels/linear/scaled_mm/marlin.py), a different
# numeric path without the throughput this option is for.
FP8_MIN_CAPABILITY = (8, 9)
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max; vLLM get_fp8_min_max on CUDA
BLOCK = (128, 128)  # vLLM fp8_per_block (online/fp8.py Fp8PerBlockOnlineLinearMethod)
# vLLM fuses these HF projections into one layer (models/llama.py packed_modules_mapping),
# stacking the shards' rows in this order; a per-tensor scale covers the fused layer.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Engine parameters that hold FP8 data (and their scale): 2-D projection weights of these
# modules. Embeddings, the head, norms and routers keep the model dtype.
QUANTIZED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantization_problem(
    quantization: str | None, where: str, capability: tuple[int, int] | None
) -> str | None:
    """Why ``rollout.quantization`` cannot run on ``where`` (a GPU of compute ``capability``;
    None: no GPU), or None when it can."""
    if quantization is None:
        return None
    if capability is None:
        return (
            f"{quantization!r} (vLLM {VLLM_QUANTIZATION[quantization]}) needs a GPU with FP8 "
            f"(compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}); {where} "
            "has none (vLLM's CPU build has no static FP8 quantizer): set rollout.quantization: "
            "null"
        )
    if tuple(capability) < FP8_MIN_CAPABILITY:
        return (
            f"{quantization!r} (vLLM {VLLM_QUANTIZATION[quantization]}) needs FP8 tensor cores "
            f"(compute capability >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: H100, "
            f"H200, B200, GB200); {where} has {capability[0]}.{capability[1]}: set "
            "rollout.quantization: null"
        )
    return None


def quantize_fp8(weight: torch.Tensor, quantization: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale) that vLLM's quantizer for ``rollout.quantization`` makes of one
    linear layer whose unquantized weight is ``weight`` [out, in] (the engine's layer: fused
    projections stacked, :func:`engine_linear_weights`; whole, as at tensor parallel 1 or after
    vLLM's TP amax all-reduce). The weight comes back [out, in] (vLLM's per-tensor path stores
    it transposed for its GEMM; the values are these).

    ``fp8``: scale = amax / 448 (shape [1]), q = clamp(w * (1 / scale), +-448) rounded to
    e4m3 (vLLM online/fp8.py:258-262 and the static kernel's multiply by the reciprocal).
    ``fp8_block``: per 128 x 128 block (edge blocks padded with zeros), scale = max(amax, 1e-4)
    / 448, q = w * (1 / scale) (vLLM ``per_block_cast_to_fp8`` without UE8M0); the scale is
    [ceil(out / 128), ceil(in / 128)] (``weight_scale_inv``)."""
    import torch

    if weight.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D linear weight, got shape {tuple(weight.shape)}")
    fp8 = torch.float8_e4m3fn
    if quantization == "fp8":
        lo, hi = weight.aminmax()  # vLLM weight_amax: in the weight's dtype
        amax = torch.maximum(lo.abs(), hi.abs()).reshape(1).to(torch.float32)
        scale = amax / torch.tensor(FP8_E4M3_MAX, device=weight.device, dtype=torch.float32)
        out = weight.to(torch.float32) * scale.reciprocal()
        return out.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(fp8), scale
    if quantization == "fp8_block":
        m, n = weight.shape
        bm, bn = BLOCK
        padded = weight.new_zeros((-(-m // bm) * bm, -(-n // bn) * bn))
        padded[:m, :n] = weight
        view = padded.view(-1, bm, padded.size(1) // bn, bn)
        amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
        scale = amax / FP8_E4M3_MAX
        q = (view * (1.0 / scale)).to(fp8).view_as(padded)[:m, :n].contiguous()
        return q, scale.view(view.size(0), view.size(2))
    raise ValueError(
        f"rollout.quantization must be one of {', '.join(QUANTIZATIONS)}; got {quantization!r}"
    )


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, quantization: str) -> torch.Tensor:
    """The float32 weight an engine computes with: ``q`` times its scale (per tensor, or per
    128 x 128 block)."""
    import torch

    w = q.to(torch.float32)
    if quantization == "fp8":
        return w * scale
    bm, bn = BLOCK
    full = scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)
    return w * full[: w.shape[0], : w.shape[1]]


def engine_linear_weights(
    named: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, torch.Tensor]:
    """The engine's quantized linear layers of a pushed bucket of HF-named tensors (dense
    models): ``...self_attn.qkv_proj.weight`` = q, k, v rows stacked, ``...mlp.gate_up_proj``
    = gate, up, other projections as they are; embeddings, head, norms and tensors whose fused
    layer is incomplete in this bucket are left out (the engine quantizes a layer once all of
    it has arrived, whichever bucket brought it)."""
    import torch

    tensors = dict(named)
    layers: dict[str, torch.Tensor] = {}
    fused_of = {part: fused for fused, parts in FUSED_PROJECTIONS.items() for part in parts}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if leaf != "weight" or proj not in QUANTIZED_MODULES or tensor.dim() != 2:
            continue
        fused = fused_of.get(proj)
        if fused is None:
            layers[name] = tensor
            continue
        key = f"{parent}.{fused}.weight"
        if key in layers:
            continue
        parts = [tensors.get(f"{parent}.{p}.weight") for p in FUSED_PROJECTIONS[fused]]
        if all(p is not None for p in parts):
            layers[key] = torch.cat(parts, dim=0)
    return layers

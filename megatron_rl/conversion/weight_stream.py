"""Megatron -> HF-named full tensors, streamed in bounded buckets (for weight pushes).

The names and the per-module conversions (q/k/v split of the fused ``linear_qkv``, gate/up split of
``linear_fc1``, Llama-4 expert packing ...) are modelopt's own export rules
(``all_mcore_hf_export_mapping``, the mapping the HF converter uses): we run modelopt's exporter
one decoder layer at a time, on full tensors. What modelopt does not do, we do here first:

- **TP**: every tensor-parallel parameter is gathered to the TP group's first rank along its
  ``partition_dim``, honouring megatron's ``partition_stride`` (a gated ``linear_fc1`` shard is
  ``[gate_r; up_r]``; stride 2 reassembles ``[gate_0; gate_1; ...; up_0; up_1; ...]``). The
  fused-qkv shard of a rank holds whole query groups, so concatenating shards gives the full
  per-group ``[q heads, k, v]`` layout that modelopt's ``QKVSlicing`` splits.
- **EP**: routed experts are gathered over the expert-tensor-parallel group (as above), then
  over the expert-parallel group; expert ``e`` of EP rank ``r`` is global expert
  ``r * num_local_experts + e``.
- **PP**: each stage exports its own layers (megatron's ``layer_number`` is global, so names are
  too), the first stage the embedding, the last the final norm and the head. With
  ``pipeline="gather"`` (default) the stages' senders forward their buckets to the first
  stage's sender over the pipeline group (point-to-point), so one rank yields the whole model;
  with ``pipeline="local"`` each stage's sender yields only its own part.

Who yields: the *sender* of a stage is its rank with TP, expert-TP, EP, CP and DP rank 0.
Every rank of the world must iterate the stream to the end (the gathers are collectives); all
other ranks yield nothing. Ranks of data-parallel replicas other than the first skip the
gathers entirely.

Where the tensors are: on the device of the model's parameters, always (the trainer's GPU,
or the host on CPU): modelopt's rules run on the gathered shards there and nothing is copied
to the host (:func:`_device_exporter_class`); every tensor is contiguous. The exporter is
made once per model and dtype and reused by every later stream.

Peak extra memory on the sender: one decoder layer in full (incl. all its experts) plus one
bucket. At TP=EP=1 tensors that need no conversion alias the model's parameters (no copy):
consume a bucket before the next optimizer step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron_rl.platform import collectives

logger = logging.getLogger(__name__)

WeightBucket = list[tuple[str, torch.Tensor]]
# Called around the export of each module group (embedding, each decoder layer, final norm,
# head): gives the group's parameters their values on entry and may free them on exit.
Materialize = Callable[[torch.nn.Module], contextlib.AbstractContextManager]
DEFAULT_BUCKET_BYTES = 256 * 2**20


@dataclass(frozen=True)
class _Role:
    """This rank's part in the stream (see the module docstring)."""

    sender: bool  # yields (or forwards) tensors
    dense: bool  # takes part in the dense TP gathers
    experts: bool  # takes part in the expert-TP gathers
    experts_ep: bool  # takes part in the EP gathers


def _role() -> _Role:
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        return _Role(True, True, True, True)
    dp0 = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    tp0 = ps.get_tensor_model_parallel_rank() == 0
    edp0 = ps.get_expert_data_parallel_rank() == 0
    etp0 = ps.get_expert_tensor_parallel_rank() == 0
    ep0 = ps.get_expert_model_parallel_rank() == 0
    return _Role(
        sender=dp0 and tp0 and edp0 and etp0 and ep0,
        dense=dp0,
        experts=edp0,
        experts_ep=edp0 and etp0,
    )


def _group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


def _gather_to_first(tensor: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Gather ``tensor`` from every rank of ``group`` onto its first rank (None elsewhere)."""
    return collectives.gather_to_first(tensor, group)


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Reassemble megatron tensor-parallel shards ``[W x shard]`` into the full tensor.

    With ``stride`` s each shard holds s chunks; chunk k of rank r is global chunk ``k * W + r``
    (megatron's strided partitioning, used for the fused gate/up ``linear_fc1``).
    """
    if stride == 1:
        return torch.cat(shards, dim)
    chunks = [shard.chunk(stride, dim) for shard in shards]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(len(shards))], dim)


def _module_tp_group(module: torch.nn.Module, expert: bool):
    from megatron.core import parallel_state as ps

    group = getattr(module, "tp_group", None)
    if group is not None:
        return group
    if expert:
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def _full_parameter(
    module: torch.nn.Module, param: torch.Tensor, expert: bool, take_part: bool
) -> torch.Tensor | None:
    """The full (TP/ETP-gathered) tensor of ``param`` on the group's first rank, else None.

    Returns ``param`` itself when it is not sharded; None on ranks that do not end up with it.
    """
    if not getattr(param, "tensor_model_parallel", False) or not dist.is_initialized():
        return param
    group = _module_tp_group(module, expert)
    if _group_size(group) == 1:
        return param
    if not take_part:
        return None
    shards = _gather_to_first(param, group)
    if shards is None:
        return None
    return unshard(shards, param.partition_dim, getattr(param, "partition_stride", 1))


def _swap_parameters(module: torch.nn.Module, expert: bool, take_part: bool, swapped: list) -> bool:
    """Replace every TP-sharded parameter under ``module`` by its full tensor (recorded in
    ``swapped`` for restoring). Returns False on ranks that do not hold the full tensors."""
    complete = True
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None:
                continue
            full = _full_parameter(sub, param, expert, take_part)
            if full is None:
                complete = False
            elif full is not param:
                sub._parameters[name] = torch.nn.Parameter(full, requires_grad=False)
                swapped.append((sub, name, param))
    return complete


def _gathered_experts(experts: torch.nn.Module, role: _Role, swapped: list) -> bool:
    """Swap a SequentialMLP's ``local_experts`` for all experts (full tensors) on the sender."""
    from megatron.core import parallel_state as ps

    local = experts.local_experts
    complete = all([_swap_parameters(expert, True, role.experts, swapped) for expert in local])
    ep_group = ps.get_expert_model_parallel_group()
    if _group_size(ep_group) == 1:
        return complete
    if not role.experts_ep:
        return False
    # everyone in the EP group holds full (ETP-gathered) local experts now
    gathered: dict[tuple[int, str, str], list[torch.Tensor]] = {}
    for index, expert in enumerate(local):
        for sub_name, sub in expert.named_modules():
            for name, param in sub._parameters.items():
                if param is not None:
                    gathered[(index, sub_name, name)] = _gather_to_first(param, ep_group)
    if dist.get_rank() != dist.get_global_rank(ep_group, 0):
        return False
    all_experts = []
    for rank in range(dist.get_world_size(ep_group)):
        for index, expert in enumerate(local):
            proxy = _shallow_copy_tree(expert)
            for sub_name, sub in proxy.named_modules():
                for name in list(sub._parameters):
                    if sub._parameters[name] is not None:
                        tensor = gathered[(index, sub_name, name)][rank]
                        sub._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
            all_experts.append(proxy)
    swapped.append((experts, "local_experts", local))
    experts._modules["local_experts"] = torch.nn.ModuleList(all_experts)
    return complete


def _shallow_copy_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` whose module tree and parameter dicts are its own (tensors shared)."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._modules = {name: _shallow_copy_tree(child) for name, child in module._modules.items()}
    return clone


@contextlib.contextmanager
def _full_tensors(module: torch.nn.Module, role: _Role):
    """Within the context, ``module`` holds full tensors on the sender; yields whether this rank
    holds them. Restores the sharded parameters on exit."""
    swapped: list = []
    try:
        complete = True
        expert_containers = [
            m for m in module.modules() if hasattr(m, "local_experts") and m is not module
        ]
        expert_ids = {id(p) for m in expert_containers for p in m.parameters()}
        # dense parameters (everything outside the routed experts)
        for sub in module.modules():
            for name, param in list(sub._parameters.items()):
                if param is None or id(param) in expert_ids:
                    continue
                full = _full_parameter(sub, param, False, role.dense)
                if full is None:
                    complete = False
                elif full is not param:
                    sub._parameters[name] = torch.nn.Parameter(full, requires_grad=False)
                    swapped.append((sub, name, param))
        for experts in expert_containers:
            complete = _gathered_experts(experts, role, swapped) and complete
        yield complete and role.sender
    finally:
        for owner, name, original in reversed(swapped):
            if name == "local_experts":
                owner._modules[name] = original
            else:
                owner._parameters[name] = original


def _make_exporter(model, dtype: torch.dtype):
    """modelopt's GPTModelExporter for ``model`` (its HF config written to a temp dir), made
    once per model and dtype and reused by every later stream (a push paid ~10 ms for the
    config's round trip through the disk, most of the fixed cost of a tiny model's push).

    The exporter is modelopt's own with one change (:func:`_device_exporter_class`): tensors
    stay on the device they are on."""
    cache = model.__dict__.setdefault("_megatron_rl_hf_exporters", {})
    exporter = cache.get(dtype)
    if exporter is None:
        exporter = cache[dtype] = _new_exporter(model, dtype)
    return exporter


def _new_exporter(model, dtype: torch.dtype):
    from megatron_rl.conversion.modelopt_bridge import modelopt_export

    modelopt_export()  # registers our mapping fixes
    arch = model.architecture
    config = copy.deepcopy(arch.text_config)
    config.architectures = [arch.hf_architecture]
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        config.save_pretrained(tmp)
        exporter = _device_exporter_class()(model, tmp, dtype=dtype)
    if exporter.arch != arch.hf_architecture:
        raise ValueError(f"modelopt has no export mapping for {arch.hf_architecture}")
    return exporter


@functools.cache
def _device_exporter_class():
    """modelopt's GPTModelExporter whose tensors stay on their device.

    modelopt 0.47.0 reads every weight as ``module.weight.to(dtype).cpu()``
    (``GPTModelExporter._get_weight_bias``): on a GPU every tensor of every push went through
    pageable host memory, and the Llama-4 experts were stacked and transposed on the CPU.
    This override is that method without ``.cpu()``; every rule (names, q/k/v and gate/up
    slicing, expert packing) stays modelopt's and now runs where the tensors live (the
    trainer's device). Tensors already in ``dtype`` are not copied (``to`` returns them)."""
    from modelopt.torch.export.unified_export_megatron import GPTModelExporter

    class DeviceGPTModelExporter(GPTModelExporter):
        def _get_weight_bias(self, module, dtype=torch.float16, name_to_value=None):
            name_to_value = {} if name_to_value is None else name_to_value
            for name in ("weight", "bias", "expert_bias"):
                tensor = getattr(module, name, None)
                # as modelopt: empty placeholders (MoE routing weights) are left out
                if isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
                    name_to_value[name] = tensor.detach().to(dtype)
            return name_to_value

    return DeviceGPTModelExporter


def _as_is(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _take(exporter) -> list[tuple[str, torch.Tensor]]:
    """The exporter's tensors so far (contiguous: what a flat buffer or a broadcast needs;
    modelopt's slices and stacks already are, so this copies nothing), and a clean exporter."""
    items = [(name, tensor.contiguous()) for name, tensor in exporter._state_dict.items()]
    exporter._state_dict.clear()
    exporter.exclude_modules.clear()
    exporter.layer_config_dict.clear()
    return items


def _iter_stage_tensors(
    model, dtype: torch.dtype | None, materialize: Materialize | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """This pipeline stage's HF-named full tensors, one module group at a time (sender only)."""
    materialize = materialize or _as_is
    role = _role()
    exporter = _make_exporter(model, dtype or model.config.params_dtype) if role.sender else None
    rules = exporter.rules if exporter is not None else {}
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        with materialize(embedding), _full_tensors(embedding, role) as full:
            if full:
                rules["word_embeddings"](embedding.word_embeddings)
                yield from _take(exporter)
    for layer in model.decoder.layers:
        with materialize(layer), _full_tensors(layer, role) as full:
            if full:
                exporter._get_transformer_layer_state_dict(layer, layer.layer_number - 1)
                yield from _take(exporter)
    final_norm = getattr(model.decoder, "final_layernorm", None)
    if final_norm is not None and role.sender:
        with materialize(final_norm):
            rules["final_layernorm"](final_norm)
            yield from _take(exporter)
    head = getattr(model, "output_layer", None)
    if head is not None and not model.share_embeddings_and_output_weights:
        with materialize(head), _full_tensors(head, role) as full:
            if full:  # the head keeps its own dtype (the FP32 head stays FP32)
                rules["output_layer"](head, dtype=head.weight.dtype)
                yield from _take(exporter)


def _buckets(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[WeightBucket]:
    bucket: WeightBucket = []
    size = 0
    for name, tensor in tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def iter_hf_weights(
    model,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    pipeline: Literal["gather", "local"] = "gather",
    materialize: Materialize | None = None,
) -> Iterator[WeightBucket]:
    """Stream the model's weights as buckets of ``(hf_name, full_tensor)``.

    ``model``: this rank's megatron GPTModel from ``megatron_rl.models.provider.build_model``
    (it carries ``model.architecture``). ``bucket_bytes``: a bucket is yielded as soon as it
    holds at least this many bytes (a single larger tensor makes a bucket of its own).
    ``dtype``: the tensors' dtype (default: the model's params dtype; the output layer keeps its
    own, so an FP32 head streams in FP32). See the module docstring for who yields what; every
    rank must exhaust the iterator. ``materialize``: a context manager entered around the
    export of each module group (embedding, each decoder layer, final norm, head), e.g. to load
    a layer of a model built on the meta device and free it afterwards (streamed conversion);
    a bucket may still reference a freed group's tensors, which stay valid.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    if pipeline not in ("gather", "local"):
        raise ValueError(f"pipeline must be 'gather' or 'local', got {pipeline!r}")
    from megatron.core import parallel_state as ps

    local = _buckets(_iter_stage_tensors(model, dtype, materialize), bucket_bytes)
    pp_size = ps.get_pipeline_model_parallel_world_size() if dist.is_initialized() else 1
    if pipeline == "local" or pp_size == 1:
        yield from local
        return
    yield from _gather_pipeline(local, _role().sender)


def _gather_pipeline(local: Iterator[WeightBucket], sender: bool) -> Iterator[WeightBucket]:
    """Forward every stage's buckets to the first stage's sender, in stage order."""
    from megatron.core import parallel_state as ps

    group = ps.get_pipeline_model_parallel_group()
    stage = ps.get_pipeline_model_parallel_rank()
    first = dist.get_global_rank(group, 0)
    if not sender:
        for _ in local:  # take part in this stage's gathers
            pass
        return
    if stage == 0:
        yield from local
        for source_stage in range(1, dist.get_world_size(group)):
            yield from _receive_buckets(dist.get_global_rank(group, source_stage), group)
        return
    for bucket in local:
        _send_bucket(bucket, first, group)
    collectives.send_object(None, dst=first, group=group)


def _send_bucket(bucket: WeightBucket, dst: int, group) -> None:
    """Send a bucket over the pipeline group (its tensors go through the group's device:
    NCCL on GPU, whatever device modelopt's exporter left them on)."""
    meta = [(name, tuple(t.shape), t.dtype) for name, t in bucket]
    collectives.send_object(meta, dst=dst, group=group)
    for _, tensor in bucket:
        collectives.send_tensor(tensor, dst=dst, group=group)


def _receive_buckets(src: int, group) -> Iterator[WeightBucket]:
    while True:
        meta = collectives.recv_object(src=src, group=group)
        if meta is None:
            return
        yield [
            (name, collectives.recv_tensor(shape, dtype, src=src, group=group))
            for name, shape, dtype in meta
        ]


def bucket_nbytes(bucket: WeightBucket) -> int:
    """Bytes held by the tensors of a bucket."""
    return sum(t.numel() * t.element_size() for _, t in bucket)

"""``rollout.weight_transport: nccl_m2n``: every trainer rank sends its own Megatron shards.

vLLM 0.32's ``nccl_m2n`` backend (``vllm/distributed/weight_transfer/m2n_*.py``) reshards each
HF-named tensor from the trainer's layout straight into the engines' layout over one NCCL
communicator: trainer ranks ``[0, T)``, an engine's workers after them. No rank gathers a full
tensor. The trainer declares its layout once: a mesh of ``T`` ranks (:class:`M2NMesh`) and, per
tensor, a placement over it (``Placements``: the tensor dim one mesh axis shards, or
``REPLICATED``). This module maps our Megatron shards onto that description
(:class:`MegatronM2NSource`, vLLM's :class:`M2NWeightSource`) and builds vLLM's own init and
update infos from it.

The source mesh. The ranks that hold distinct shards are the first ``A = max(TP, EP)`` ranks
of the world (megatron's rank order ``tp-cp-ep-dp-pp``, expert tensor parallel 1: rank ``r`` is
TP rank ``r % TP`` and EP rank ``r % EP``); they form the mesh ``(A, 1)`` (vLLM's 1-D
convention), m2n rank = global rank. Data- and context-parallel replicas hold copies and do not
take part. So TP and EP must each be 1 or ``A`` (TP=2/EP=4 would shard dense and expert
tensors over different rank sets, which one mesh cannot describe), pipeline parallel 1 (a stage
holds only its own layers: m2n has no placement for "held by some ranks only"), expert tensor
parallel 1 (also what our Llama-4 import requires).

What each source rank holds, per HF tensor (placement over the ``(A, 1)`` mesh; ``(d, R)`` =
dim ``d`` split evenly in rank order):

- ``q_proj`` / ``k_proj`` / ``v_proj``: ``(0, R)`` at TP > 1. Megatron's fused ``linear_qkv``
  shard of TP rank ``t`` is ``[q heads of group g, k_g, v_g]`` for its query groups
  ``g in [t*G/TP, (t+1)*G/TP)``: the rank splits it locally (a view per group) into its q, k
  and v rows, which ARE rows ``t`` of ``TP`` equal blocks of the HF tensors (HF orders q heads
  by group). No RoPE permutation: Llama-3 (rotate-half) and Llama-4 (interleaved) are stored
  alike on both sides, as modelopt's export rules say.
- ``gate_proj`` / ``up_proj`` (dense MLP, Llama-4 shared expert): ``(0, R)``; the
  ``linear_fc1`` shard is ``[gate_t; up_t]`` (megatron's stride 2), split locally in two.
- ``o_proj`` / ``down_proj``: ``(1, R)`` (row-parallel ``linear_proj`` / ``linear_fc2``).
- ``embed_tokens`` / ``lm_head``: ``(0, R)`` (vocab-parallel rows; we never pad the vocab:
  ``check_divisibility`` requires TP to divide it). The head keeps its dtype (FP32 head).
- Llama-4 routed experts (HF stacks them: ``experts.gate_up_proj [E, H, 2I]``,
  ``experts.down_proj [E, I, H]``): ``(0, R)`` at EP > 1: EP rank ``r`` owns experts
  ``r*E/EP .. (r+1)*E/EP - 1`` whole, i.e. rows ``r`` of ``EP`` blocks of dim 0; the rank stacks
  its ``linear_fc1.T`` / ``linear_fc2.T`` locally (one copy, on its device).
- norms, the router, and everything at TP = EP = 1: ``REPLICATED`` (every source rank holds
  it; m2n picks the senders).

Every Megatron parameter must land in exactly one HF tensor: a parameter this map does not
know (a bias, a new module) raises at construction, naming it, instead of leaving the engines
with stale weights.

The destination. vLLM's worker engine (``M2NWeightTransferEngine``) computes a worker's rank as
``rank_offset + its rank in its engine``, with ``rank_offset`` the number of trainer ranks, so
the engines of our pool, separate vLLM instances, cannot share one communicator: each engine
gets its own (``T + tp`` ranks, destination mesh ``(1, tp)``), and the trainer reshards every
tensor once per engine. The source ranks split those bytes between them (no rank sends more
than its shards), but the bytes leaving the trainer grow with the engines, where the ``nccl``
broadcast sends them once. That, and the runtime below, is why ``auto`` never picks this
transport.

Runtime: ``nccl.m2n`` from NVIDIA's nccl-extensions (with ``nccl4py``, NCCL >= 2.30.5); not a
vLLM dependency. :func:`require_runtime` turns its absence into an error naming the recipe key.

How the push drives it (:mod:`.m2n_ranks`): the pool lives on rank 0, the other source
ranks follow it on a gloo group of the source ranks, listening around the pool's start and
inside ``push_megatron_weights`` (every push and reweigh). When the pool forms its group
(start, after a death, a reweigh of restarted engines), every source rank joins one
communicator per engine through :func:`start_trainer_engine` (rank 0's client sends the
engine its ``JoinTransport``); per bucket, rank 0 announces the names to the engines
(:func:`update_payload`) and every source rank reshards its own blocks of them into each
engine's communicator in turn (:func:`send_blocks`). Ranks 1..A-1 return from the push when
rank 0's has returned; replicas return at once; nobody streams HF buckets.

Verified (CPU, ``tests/unit/rollout/test_weight_m2n.py``): the placements and local blocks we
publish for TP=2 dense and tied Llama, TP=2 Llama-4, EP=2 Llama-4 and a TP=1 rank with two
query groups (real megatron shards, two gloo ranks) are exactly their placements' slices of the
transformers model's tensors; vLLM's own layout checks (``check_transferable``,
``resolve_layout``, ``validate_layout``, ``check_plan_limits``) and init info dataclasses accept
them, and our worker payload equals the one vLLM's trainer engine builds; a vLLM CPU engine
built with this backend takes our TP=2 plan through ``init_transport`` and plans a destination
for every name against its live model (all full-tensor fallbacks on CPU, whose build repacks
the linear weights; on GPU its RowParallelLinear loaders may take o_proj / down_proj directly:
not checked); vLLM's trainer engine, run with our source on both TP ranks, hands ``nccl.m2n``
each rank's own blocks in order with the meshes we declared, calls the engines from rank 0
only, and refuses to start without ``nccl.m2n`` before calling them. And
(``test_weight_m2n_ranks.py``, four gloo ranks TP 2 x DP 2, the real pool on fake engines):
both source ranks join each engine's communicator when the pool starts, leave and join anew
when a death or a reweigh re-forms the group, hand m2n their own blocks (live: updated weights
in later pushes) once per engine communicator in the same order, rank 0 alone announcing every
name once per engine; the replicas join, send and stream nothing. Stand-ins in those tests:
the rendezvous, the destination-plan broadcast, the raw communicator and ``nccl.m2n``.

Not verified: any NCCL call (no GPU here; the lent one is single, without vLLM or
``nccl.m2n``), hence neither m2n's own checks of our plan at run time, the bytes landing in a
CUDA engine's parameters, nor rank 0's helper-thread sends with the CUDA device and stream.
On a failure rank 0 tells the others (``Abort``) unless they are stuck in a collective with
the engines; they then fail by the gloo group's timeout (the longer of
``rollout.startup_timeout_minutes`` and ``rollout.push_timeout_seconds``) or when rank 0's
process exits.

Cost: one communicator per engine (see above): N engines cost the trainer N model copies of
link traffic, spread over its A source ranks, against one copy for the ``nccl`` broadcast
after its gather. m2n wins when the gather is the bottleneck (large TP / EP, few engines).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.m2n_common import (
    REPLICATE,
    REPLICATED,
    M2NMesh,
    M2NParamMeta,
    Placements,
    check_plan_limits,
    check_transferable,
    comm_ptr,
    import_m2n,
    resolve_layout,
    to_mesh,
    to_placements,
    validate_layout,
)
from vllm.distributed.weight_transfer.m2n_engine import (
    M2NWeightTransferInitInfo,
    M2NWeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.m2n_source import M2NWeightSource
from vllm.distributed.weight_transfer.m2n_trainer import M2NTrainerInitInfo

logger = logging.getLogger(__name__)

BACKEND = "nccl_m2n"  # vLLM's registered backend (engine and trainer side)
KEY = "rollout.weight_transport"


def require_runtime() -> Any:
    """``nccl.m2n`` (vLLM's lazy import), or a ``ValueError`` naming the recipe key."""
    try:
        return import_m2n()
    except ImportError as err:
        raise ValueError(
            f"{KEY} 'nccl_m2n' needs the nccl.m2n runtime (NVIDIA nccl-extensions with nccl4py, "
            "NCCL >= 2.30.5; VLLM_NCCL_SO_PATH set to the libnccl.so it was linked against), "
            f"which is not importable here ({err.__cause__ or err}); use 'nccl'"
        ) from err


# -- where this rank sits in the trainer's source mesh --------------------------------------


@dataclass(frozen=True)
class SourceLayout:
    """The trainer's side of m2n: ``size`` source ranks (mesh ``(size, 1)``), this one's
    ``rank``; ``tensor`` / ``expert``: the TP / EP sizes (each 1 or ``size``)."""

    rank: int
    size: int
    tensor: int
    expert: int

    def __post_init__(self) -> None:
        for name in ("tensor", "expert"):
            if getattr(self, name) not in (1, self.size):
                raise ValueError(
                    f"nccl_m2n: parallel.{name}={getattr(self, name)} with source mesh size "
                    f"{self.size}: TP and EP must each be 1 or max(TP, EP)"
                )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"nccl_m2n: source rank {self.rank} outside [0, {self.size})")

    @property
    def mesh(self) -> M2NMesh:
        return M2NMesh((self.size, 1), 0)

    def dense(self, dim: int) -> Placements | None:
        """A TP-sharded tensor's placement (split along ``dim``)."""
        return (dim, REPLICATE) if self.tensor > 1 else REPLICATED

    @property
    def experts(self) -> Placements | None:
        """The stacked routed experts' placement (split along the expert dim)."""
        return (0, REPLICATE) if self.expert > 1 else REPLICATED


def source_layout(
    rank: int, tensor: int, expert: int, pipeline: int = 1, expert_tensor: int = 1
) -> SourceLayout | None:
    """This trainer rank's place in the source mesh, or None when it holds copies only (a
    data- or context-parallel replica). Raises ``ValueError`` for layouts m2n cannot take."""
    # One statement of the limits, shared with the check at config load.
    from megatron_rl.config.checks import m2n_layout_problem

    problem = m2n_layout_problem(tensor, expert, pipeline, expert_tensor)
    if problem is not None:
        raise ValueError(f"{KEY} {problem}")
    size = max(tensor, expert)
    if rank >= size:
        return None
    return SourceLayout(rank, size, tensor, expert)


def megatron_source_layout() -> SourceLayout | None:
    """:func:`source_layout` of this rank from megatron's parallel state, checked against its
    TP / EP ranks (the mesh assumes megatron's default rank order)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = source_layout(
        rank,
        ps.get_tensor_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
    )
    if layout is not None:
        tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
        if tp != rank % layout.tensor or ep != rank % layout.expert:
            raise ValueError(
                f"nccl_m2n: rank {rank} is TP rank {tp} and EP rank {ep}; the source mesh needs "
                "megatron's default order (tp-cp-ep-dp-pp)"
            )
    return layout


# -- Megatron shards -> HF-named local blocks ------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One HF tensor: its metadata (full shape, wire dtype, placement) and how this rank
    makes its block (``local()``: read from the live parameters at each call)."""

    meta: M2NParamMeta
    local: Callable[[], torch.Tensor]


def _qkv_split(weight: torch.Tensor, groups: int, heads_per_group: int) -> list[torch.Tensor]:
    """A rank's fused ``linear_qkv`` rows ``[groups x (q heads, k, v) x d, ...]`` as its q, k,
    v rows (views)."""
    rest = weight.shape[1:]
    per_group = weight.view(groups, heads_per_group + 2, -1, *rest)
    q = per_group[:, :heads_per_group].reshape(-1, *rest)
    k = per_group[:, heads_per_group].reshape(-1, *rest)
    v = per_group[:, heads_per_group + 1].reshape(-1, *rest)
    return [q, k, v]


class MegatronM2NSource(M2NWeightSource):
    """vLLM's :class:`M2NWeightSource` over one source rank's Megatron ``GPTModel`` (see the
    module docstring for the placements). ``metadata()`` describes the whole model (the same
    on every source rank); iteration yields this rank's blocks, computed locally from the live
    parameters, in the same order; ``dtype``: the wire dtype (default: the model's params
    dtype; the output layer keeps its own). ``hf_architecture``: the HF config's
    ``architectures[0]`` (Llama or Llama-4)."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: SourceLayout,
        hf_architecture: str,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.layout = layout
        self.dtype = dtype or model.config.params_dtype
        prefix = "language_model." if hf_architecture == "Llama4ForConditionalGeneration" else ""
        self._llama4 = hf_architecture.startswith("Llama4")
        self._used: set[int] = set()
        self._entries = [
            Entry(
                M2NParamMeta(prefix + e.meta.name, e.meta.dtype, e.meta.shape, e.meta.placements),
                e.local,
            )
            for e in self._build(model)
        ]
        unused = [n for n, p in model.named_parameters() if id(p) not in self._used]
        if unused:
            raise ValueError(f"nccl_m2n: no HF tensor for megatron parameter(s) {unused}")
        for entry in self._entries:
            check_source_entry(self.layout.mesh, entry.meta)

    # -- WeightSource ---------------------------------------------------------------------
    def mesh(self) -> M2NMesh:
        return self.layout.mesh

    def metadata(self) -> list[M2NParamMeta]:
        return [e.meta for e in self._entries]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for entry in self._entries:
            yield entry.meta.name, entry.local()

    def blocks(self, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
        """This rank's blocks of ``names`` (in that order), read from the live parameters."""
        by_name = {e.meta.name: e for e in self._entries}
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"nccl_m2n: no HF tensor named {unknown} in this rank's source")
        return [(n, by_name[n].local()) for n in names]

    # -- the map ----------------------------------------------------------------------------
    def _param(self, param: torch.Tensor) -> torch.Tensor:
        self._used.add(id(param))
        return param

    def _entry(
        self,
        name: str,
        block: Callable[[], torch.Tensor],
        placements: Placements | None,
        dtype: torch.dtype | None = None,
    ) -> Entry:
        """An HF tensor whose block on this rank is ``block()`` (cast to the wire dtype)."""
        dtype = dtype or self.dtype
        shape = list(block().shape)  # one evaluation at construction: cheap views / stacks
        if placements is not REPLICATED:
            shape[placements[0]] *= self.layout.size
        return Entry(M2NParamMeta(name, dtype, tuple(shape), placements), lambda: block().to(dtype))

    def _build(self, model: torch.nn.Module) -> list[Entry]:
        layout = self.layout
        entries = []
        if getattr(model, "pre_process", True):
            emb = self._param(model.embedding.word_embeddings.weight)
            entries.append(self._entry("model.embed_tokens.weight", lambda: emb, layout.dense(0)))
        for layer in model.decoder.layers:
            entries += self._layer(model.config, layer, f"model.layers.{layer.layer_number - 1}.")
        final = self._param(model.decoder.final_layernorm.weight)
        entries.append(self._entry("model.norm.weight", lambda: final, REPLICATED))
        head = getattr(model, "output_layer", None)
        if head is not None and not model.share_embeddings_and_output_weights:
            weight = self._param(head.weight)
            entries.append(
                self._entry("lm_head.weight", lambda: weight, layout.dense(0), weight.dtype)
            )
        return entries

    def _norm(self, layer: torch.nn.Module, own: str, fused_into: torch.nn.Module | None):
        """A pre-norm weight: the layer's own norm module (local spec), or the one Transformer
        Engine fuses into the next linear (``layer_norm_weight``)."""
        norm = getattr(layer, own, None)
        weight = getattr(norm, "weight", None)
        if weight is None:
            weight = getattr(fused_into, "layer_norm_weight", None)
        if weight is None:
            raise ValueError(f"nccl_m2n: no weight for {own} of layer {layer.layer_number}")
        return self._param(weight)

    def _layer(self, config, layer: torch.nn.Module, p: str) -> list[Entry]:
        layout = self.layout
        attn = layer.self_attention
        qkv = attn.linear_qkv
        groups = config.num_query_groups // layout.tensor
        heads_per_group = config.num_attention_heads // config.num_query_groups
        entries = []
        for attr, suffix in (("weight", "weight"), ("bias", "bias")):
            fused = getattr(qkv, attr, None)
            # Transformer Engine keeps ``bias = torch.Tensor()`` (zero elements) when there
            # is none: not a weight (as ``weight_stream``'s exporter, which skips numel 0).
            if not isinstance(fused, torch.Tensor) or fused.numel() == 0:
                continue
            fused = self._param(fused)
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                entries.append(
                    self._entry(
                        f"{p}self_attn.{proj}.{suffix}",
                        lambda i=i, f=fused: _qkv_split(f, groups, heads_per_group)[i],
                        layout.dense(0),
                    )
                )
        proj = self._param(attn.linear_proj.weight)
        entries.append(self._entry(f"{p}self_attn.o_proj.weight", lambda: proj, layout.dense(1)))
        ln1 = self._norm(layer, "input_layernorm", qkv)
        entries.append(self._entry(f"{p}input_layernorm.weight", lambda: ln1, REPLICATED))
        mlp = layer.mlp
        ln2 = self._norm(layer, "pre_mlp_layernorm", getattr(mlp, "linear_fc1", None))
        entries.append(self._entry(f"{p}post_attention_layernorm.weight", lambda: ln2, REPLICATED))
        ffn = f"{p}feed_forward." if self._llama4 else f"{p}mlp."
        if hasattr(mlp, "router"):
            entries += self._moe(mlp, ffn)
        else:
            entries += self._gated_mlp(mlp, ffn)
        return entries

    def _gated_mlp(self, mlp: torch.nn.Module, p: str) -> list[Entry]:
        """``gate_proj`` / ``up_proj`` (the fc1 shard ``[gate_t; up_t]`` halved) and
        ``down_proj``, each TP-sharded."""
        fc1 = self._param(mlp.linear_fc1.weight)
        fc2 = self._param(mlp.linear_fc2.weight)
        return [
            self._entry(f"{p}gate_proj.weight", lambda: fc1.chunk(2)[0], self.layout.dense(0)),
            self._entry(f"{p}up_proj.weight", lambda: fc1.chunk(2)[1], self.layout.dense(0)),
            self._entry(f"{p}down_proj.weight", lambda: fc2, self.layout.dense(1)),
        ]

    def _moe(self, mlp: torch.nn.Module, p: str) -> list[Entry]:
        """Llama-4's MoE block: router, stacked routed experts (this rank's, whole), shared
        expert."""
        if not self._llama4:
            raise ValueError("nccl_m2n: routed experts are mapped for Llama-4 only")
        router = self._param(mlp.router.weight)
        experts = list(getattr(mlp.experts, "local_experts", ()))
        if not experts:
            raise ValueError("nccl_m2n: needs SequentialMLP experts (moe_grouped_gemm off)")
        fc1 = [self._param(e.linear_fc1.weight) for e in experts]
        fc2 = [self._param(e.linear_fc2.weight) for e in experts]
        entries = [
            self._entry(f"{p}router.weight", lambda: router, REPLICATED),
            # HF: gate_up_proj[e] = [gate | up] columns = linear_fc1 [gate; up] rows, transposed
            self._entry(
                f"{p}experts.gate_up_proj",
                lambda: torch.stack([w.t() for w in fc1]),
                self.layout.experts,
            ),
            self._entry(
                f"{p}experts.down_proj",
                lambda: torch.stack([w.t() for w in fc2]),
                self.layout.experts,
            ),
        ]
        shared = getattr(mlp, "shared_experts", None)
        if shared is not None:
            entries += self._gated_mlp(shared, f"{p}shared_expert.")
        return entries


# -- vLLM's checks and wire types ------------------------------------------------------------


def check_source_entry(mesh: M2NMesh, meta: M2NParamMeta) -> None:
    """vLLM's own checks of one source tensor (what its trainer engine runs at init)."""
    check_transferable(meta.name, meta.dtype, meta.shape)
    resolved = resolve_layout(mesh, meta.placements, f"parameter '{meta.name}' source placements")
    validate_layout(*resolved, meta.shape, "source")


def check_plan(source: M2NWeightSource, dst_mesh: M2NMesh) -> None:
    """vLLM's fan-in / fan-out limits for every tensor into a replicated destination (the
    fallback an engine may pick for any tensor: the bound that always applies)."""
    for meta in source.metadata():
        src = resolve_layout(source.mesh(), meta.placements)
        check_plan_limits(src, resolve_layout(dst_mesh, REPLICATED), meta.name)


def trainer_init_info(
    layout: SourceLayout,
    address: str,
    port: int,
    engine_tensor_parallel: int,
    max_cta: int | None = None,
) -> M2NTrainerInitInfo:
    """vLLM's trainer init info of one engine's communicator: the ``layout.size`` source ranks
    then the engine's ``engine_tensor_parallel`` workers (destination mesh ``(1, tp)``: axis 1
    shards, as vLLM's worker plans)."""
    return M2NTrainerInitInfo(
        rank=layout.rank,
        master_address=address,
        master_port=port,
        world_size=layout.size + engine_tensor_parallel,
        num_trainer_ranks=layout.size,
        dst_mesh_dims=(1, engine_tensor_parallel),
        max_cta=max_cta,
    )


def worker_init_info(
    source: M2NWeightSource, info: M2NTrainerInitInfo
) -> M2NWeightTransferInitInfo:
    """vLLM's worker init info (the engines' ``init_weight_transfer_engine``) for ``source``
    over the communicator of ``info``: both meshes and the whole plan (validated by vLLM's
    ``__post_init__``)."""
    metas = source.metadata()
    return M2NWeightTransferInitInfo(
        master_address=info.master_address,
        master_port=info.master_port,
        nccl_unique_id_b64=info.nccl_unique_id_b64,
        rank_offset=info.num_trainer_ranks,
        world_size=info.world_size,
        src_mesh_dims=list(source.mesh().dims),
        dst_mesh_dims=list(info.destination_mesh_dims),
        names=[m.name for m in metas],
        dtype_names=[str(m.dtype).removeprefix("torch.") for m in metas],
        shapes=[list(m.shape) for m in metas],
        src_placements=[None if m.placements is None else list(m.placements) for m in metas],
        max_cta=info.max_cta,
    )


def worker_payload(init_info: M2NWeightTransferInitInfo) -> dict[str, Any]:
    """The ``init_weight_transfer_engine`` payload (unset fields dropped, as vLLM sends it)."""
    return {k: v for k, v in asdict(init_info).items() if v is not None}


def update_payload(names: Sequence[str]) -> dict[str, Any]:
    """The ``update_weights`` payload of one round (vLLM's update info: names, in send order)."""
    return asdict(M2NWeightTransferUpdateInfo(names=list(names)))


def start_trainer_engine(source: M2NWeightSource, info: M2NTrainerInitInfo, client: Any) -> Any:
    """vLLM's trainer engine for ``source`` on this source rank (every source rank calls it;
    rank 0 drives ``client``, a ``VLLMWeightSyncClient``). Refuses first, naming the recipe
    key, when ``nccl.m2n`` is missing; then vLLM validates the plan, starts the engines' init,
    joins the communicator and receives their destination plan."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    require_runtime()
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def send_blocks(engine: Any, blocks: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Reshard ``blocks`` (this rank's, named as in the source's metadata) over the
    communicator of ``engine`` (vLLM's trainer engine from :func:`start_trainer_engine`),
    each into the destination the engine's workers planned for it: what vLLM 0.32's
    ``M2NTrainerWeightTransferEngine._send`` does for the whole source in one round, here for
    one bucket of it (its public ``send_weights`` would also drive the engines' update RPCs,
    which our pool announces itself, bucket by bucket). Every source rank must call this with
    the same names in the same order: m2n's reshard is collective over the communicator."""
    from megatron_rl.platform import current_stream

    m2n = engine._m2n
    comm = comm_ptr(engine.group)
    stream = current_stream()
    positions = {meta.name: i for i, meta in enumerate(engine._metas)}
    for name, block in blocks:
        index = positions[name]
        shard = block.detach().contiguous()
        src_mesh, src_placements = resolve_layout(engine._src_mesh, engine._metas[index].placements)
        dst_mesh, dst_placements = resolve_layout(engine._dst_mesh, engine._dst_placements[index])
        m2n.reshard(
            shard,
            None,
            comm,
            stream,
            src_mesh=to_mesh(m2n, src_mesh),
            src_placements=to_placements(m2n, src_placements),
            dst_mesh=to_mesh(m2n, dst_mesh),
            dst_placements=to_placements(m2n, dst_placements),
            handle=engine._handle,
        )
        if stream is not None:
            shard.record_stream(stream)  # m2n keeps the pointer for its asynchronous work
    if stream is not None:
        stream.synchronize()  # the caller may change the parameters once this returns

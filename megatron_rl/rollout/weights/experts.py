"""Expert-parallel engines: which routed experts each engine rank holds, and its part of a push.

With ``rollout.expert_parallel`` vLLM gives each of an engine's ``tensor_parallel`` ranks whole
routed experts (``FusedMoEParallelConfig.make``: EP size = TP x DP size, EP rank = the flattened
TP rank; attention stays tensor-parallel). Which ones is vLLM's own rule,
``determine_expert_map`` (``vllm/model_executor/layers/fused_moe/expert_map_manager.py``):
:class:`ExpertPlacement` asks it, it never re-derives it.

A weight push then hands rank r only its experts (:func:`rank_bucket`):

- dense tensors (attention, norms, router, shared expert, embedding, head) go to every rank;
- per-expert tensors (``...experts.{e}.{gate,up,down}_proj.weight``: Qwen3-MoE) go to the
  rank that holds expert e;
- Llama-4's packed tensors (``...experts.gate_up_proj [E, hidden, 2 ffn]``,
  ``...experts.down_proj [E, ffn, hidden]``, what the HF checkpoint and our stream carry) are
  split into those per-expert names (views, no copy). vLLM's packed loader cannot take a
  rank's slice of a pack: it indexes the pack with global expert ids
  (``llama4.py`` ``load_moe_expert_weights``: ``new_loaded_weight[local_expert_indices]``).
  Its per-expert path maps a global expert id to the rank's slot and skips the experts a
  rank does not hold (``RoutedExperts.weight_loader``: ``expert_id == -1`` returns), so the
  per-expert names load on every placement.

The engine side (:mod:`megatron_rl.rollout.weights.cpu_backend`; on GPU :mod:`megatron_rl.rollout.weights.nccl`,
which broadcasts each rank's experts in a group of its own) picks its rank's part of an update
and checks that its layers' expert maps are the placement the sender split for.

vLLM 0.32's CPU build cannot run such an engine as shipped: its fused-MoE kernel ignores the
expert map (:func:`fix_cpu_moe_expert_map`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.conversion.weight_stream import WeightBucket

EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_PER_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_PACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def routed_expert_count(text_config: Any) -> int:
    """Routed experts per MoE layer of an HF (text) config; 0 for a dense model."""
    return next((int(n) for k in EXPERT_COUNT_KEYS if (n := getattr(text_config, k, 0))), 0)


@dataclass(frozen=True)
class ExpertPlacement:
    """The global expert ids held by each EP rank of one engine, in local-slot order."""

    num_experts: int
    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def from_vllm(cls, num_experts: int, ep_size: int, strategy: str = "linear") -> ExpertPlacement:
        """vLLM's placement of ``num_experts`` experts over ``ep_size`` ranks
        (``determine_expert_map``; "linear" is vLLM's default ``expert_placement_strategy``,
        and the only one for models without expert groups such as Llama-4 and Qwen3-MoE)."""
        from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

        if num_experts < 1 or ep_size < 1:
            raise ValueError(f"need experts and ranks >= 1, got {num_experts}, {ep_size}")
        ranks = []
        for rank in range(ep_size):
            _, expert_map, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
            ranks.append(held_experts(expert_map, num_experts))
        return cls(num_experts, tuple(ranks))

    @property
    def ep_size(self) -> int:
        return len(self.ranks)

    def owner(self, expert: int) -> int:
        """The EP rank that holds global expert ``expert``."""
        for rank, experts in enumerate(self.ranks):
            if expert in experts:
                return rank
        raise ValueError(f"expert {expert} is on no rank of {self.num_experts} experts")


def held_experts(expert_map: torch.Tensor | None, num_experts: int) -> tuple[int, ...]:
    """Global ids of the experts a vLLM ``expert_map`` (global -> local slot, -1: elsewhere;
    None: no EP) holds, ordered by local slot."""
    if expert_map is None:
        return tuple(range(num_experts))
    held = [(int(slot), g) for g, slot in enumerate(expert_map.tolist()) if slot >= 0]
    return tuple(g for _, g in sorted(held))


def rank_bucket(bucket: WeightBucket, placement: ExpertPlacement, rank: int) -> WeightBucket:
    """The part of ``bucket`` that EP rank ``rank`` loads: every dense tensor, and the routed
    experts it holds, per expert (see the module docstring). Tensors are views of the
    bucket's."""
    dense, experts = split_experts(bucket, placement, (rank,))
    return dense + experts[0]


def split_bucket(bucket: WeightBucket, placement: ExpertPlacement) -> list[WeightBucket]:
    """:func:`rank_bucket` for every EP rank."""
    return [rank_bucket(bucket, placement, r) for r in range(placement.ep_size)]


def split_experts(
    bucket: WeightBucket, placement: ExpertPlacement, ranks: tuple[int, ...] | None = None
) -> tuple[WeightBucket, list[WeightBucket]]:
    """(the dense tensors of ``bucket``, the routed experts of each EP rank of ``ranks``
    (default: all), per expert): each expert's tensors in exactly one rank's list. Tensors
    are views of the bucket's, in bucket order."""
    ranks = tuple(range(placement.ep_size)) if ranks is None else ranks
    held = [set(placement.ranks[r]) for r in ranks]
    dense: WeightBucket = []
    experts: list[WeightBucket] = [[] for _ in ranks]
    for name, tensor in bucket:
        packed = _PACKED.match(name)
        if packed and tensor.dim() == 3:
            for part, mine in zip(experts, held):
                part.extend(_unpack(packed["prefix"], packed["kind"], tensor, placement, mine))
            continue
        per_expert = _PER_EXPERT.search(name)
        if per_expert is None:
            dense.append((name, tensor))
            continue
        for part, mine in zip(experts, held):
            if int(per_expert[1]) in mine:
                part.append((name, tensor))
    return dense, experts


def _unpack(
    prefix: str, kind: str, packed: torch.Tensor, placement: ExpertPlacement, mine: set[int]
) -> WeightBucket:
    """HF Llama-4 packs, transposed: ``gate_up_proj [E, hidden, 2 ffn]`` -> per expert
    ``gate_proj.weight`` / ``up_proj.weight [ffn, hidden]``; ``down_proj [E, ffn, hidden]``
    -> ``down_proj.weight [hidden, ffn]`` (the nn.Linear layout of per-expert checkpoints)."""
    if packed.shape[0] != placement.num_experts:
        raise ValueError(
            f"{prefix}.{kind} packs {packed.shape[0]} experts; the engines' placement has "
            f"{placement.num_experts}"
        )
    out: WeightBucket = []
    for expert in sorted(mine):
        weight = packed[expert]
        if kind == "gate_up_proj":
            gate, up = weight.chunk(2, dim=-1)
            out.append((f"{prefix}.{expert}.gate_proj.weight", gate.t()))
            out.append((f"{prefix}.{expert}.up_proj.weight", up.t()))
        else:
            out.append((f"{prefix}.{expert}.down_proj.weight", weight.t()))
    return out


def model_rank_experts(model: torch.nn.Module) -> tuple[int, tuple[int, ...]] | None:
    """(EP rank, global experts held) of this engine worker, read from its vLLM MoE layers
    (``RoutedExperts``: ``moe_config.moe_parallel_config.ep_rank`` and ``expert_map``); None
    for a model without routed experts. Every MoE layer must agree."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    seen = {
        (
            m.moe_config.moe_parallel_config.ep_rank,
            held_experts(m.expert_map, m.global_num_experts),
        )
        for m in model.modules()
        if isinstance(m, RoutedExperts)
    }
    if len(seen) > 1:
        raise ValueError(f"this engine rank's MoE layers disagree on their experts: {seen}")
    return next(iter(seen), None)


def expert_parallel_update(parts: list[Any], placement: ExpertPlacement) -> dict[str, Any]:
    """An update info made of one part per EP rank (``parts[r]``: what rank r loads, an update
    info of the transport) and the placement they were split for."""
    assert len(parts) == placement.ep_size
    return {"ep_ranks": parts, "ep_experts": [list(r) for r in placement.ranks]}


def own_part(update: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """This engine rank's part of an update info (the update itself when it is not split per
    EP rank). Raises ``ValueError`` when the worker holds other experts than the sender
    split for (a placement that is not vLLM's linear one, e.g. EPLB)."""
    if "ep_ranks" not in update:
        return update
    mine = model_rank_experts(model)
    expected = [tuple(r) for r in update["ep_experts"]]
    if mine is None or mine[0] >= len(expected) or mine[1] != expected[mine[0]]:
        raise ValueError(
            f"the weight push was split for experts per EP rank {expected}; this engine rank "
            f"(EP rank, experts) is {mine}"
        )
    return update["ep_ranks"][mine[0]]


def engine_placement(rollout: Any, text_config: Any) -> ExpertPlacement | None:
    """Each engine rank's experts under ``rollout`` (a ``RolloutConfig``) for a model of
    ``text_config``; None without ``rollout.expert_parallel``. An engine is one vLLM instance
    (data parallel size 1), so its EP size is ``rollout.tensor_parallel``."""
    if not rollout.expert_parallel:
        return None
    experts = routed_expert_count(text_config)
    if not experts:
        raise ValueError("rollout.expert_parallel: the model has no routed experts")
    return ExpertPlacement.from_vllm(experts, rollout.tensor_parallel)


def fix_cpu_moe_expert_map() -> None:
    """Upstream bug, vLLM 0.32 CPU build: its unquantized fused-MoE kernel
    (``CPUUnquantizedExperts.apply`` -> ``torch.ops._C.cpu_fused_moe``) takes no expert map.
    Under expert parallelism a rank holds ``E / ep`` experts (``w13 [E / ep, ...]``) but the
    router's ``topk_ids`` are global expert ids, and nothing maps them to local slots (the
    modular kernel passes ``expert_map`` to ``apply``, which drops it; no-DP/EP prepare does
    not remap): the kernel reads past the rank's weights (garbage outputs, or a segfault in
    ``fused_moe_impl``). Here ``apply`` maps ids through ``expert_map`` and gives experts held
    elsewhere no weight; a token none of whose experts is local gets a zero row (with
    ``apply_router_weight_on_input`` the kernel does not apply the weights). The ranks' partial
    outputs are then summed by vLLM's usual all-reduce. Idempotent; a no-op without EP."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU kernels: nothing to fix
        return
    original = CPUUnquantizedExperts.apply
    if getattr(original, "_maps_experts", False):
        return

    def apply(self, **kw: Any) -> None:  # vLLM calls it with keywords only
        expert_map = kw["expert_map"]
        if expert_map is None:
            return original(self, **kw)
        local = expert_map[kw["topk_ids"].long()]
        held = local >= 0
        ids = torch.where(held, local, 0).to(kw["topk_ids"].dtype).contiguous()
        weights = (kw["topk_weights"] * held).to(kw["topk_weights"].dtype).contiguous()
        original(self, **{**kw, "topk_ids": ids, "topk_weights": weights, "expert_map": None})
        kw["output"][~held.any(dim=-1)] = 0

    apply._maps_experts = True
    CPUUnquantizedExperts.apply = apply

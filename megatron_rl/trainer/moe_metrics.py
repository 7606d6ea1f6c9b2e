"""Expert-load metrics of the MoE layers, per layer and step: tokens per expert, load
imbalance (max / mean), router entropy, dropped-token fraction, and megatron-core's own
auxiliary losses (load balancing, z-loss) when the recipe turns them on.

A forward hook on each of megatron-core's ``TopKRouter`` modules adds, on the device and
without a host sync, one row per MoE layer of a ``[moe_layers, experts + COLUMNS]`` buffer:

- tokens per expert: the router's top-k choices *before* capacity dropping (they sum to
  tokens x topk), from its ``routing_map`` (recomputed with megatron's
  ``topk_routing_with_score_function`` only when a capacity factor may have dropped some);
- dropped: choices the capacity factor removed (``routing_map`` after dropping);
- entropy: the sum over tokens of the entropy (nats) of the router's normalised scores,
  as megatron-core's aux loss sees them (``compute_routing_scores_for_aux_loss``: softmax,
  or sigmoid scores over their sum for Llama-4's sigmoid router);
- tokens the router saw and router calls (micro-batches).

Micro-batch padding (megatron's ``padding_mask``, which the step passes the model) counts
nowhere, as megatron-core's aux and z losses leave it out: the numbers of a padded batch are
those of the same batch unpadded (the experts still compute the padding).

Only training forwards count: grad enabled, as megatron's own expert-bias counter, so a
layer recomputed under full activation recompute counts once (its first, no-grad pass is
skipped) and evaluation forwards never count. Once per step :meth:`ExpertLoadMonitor.reduce`
sums the buffer over the ranks that see different tokens (data, context, and tensor
parallel under sequence parallelism: expert-parallel ranks are data-parallel ranks to the
router) and over pipeline stages (each fills the rows of its own layers): two all-reduces
through ``platform.collectives``, then one copy to the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_rl.platform import collectives

# Buffer columns after the experts' token counts.
DROPPED, ENTROPY, TOKENS, CALLS = range(4)
COLUMNS = 4

# megatron-core's aux-loss tracker names, by load-balancing type, and the ranks whose
# values are partial sums of one loss (the loss's reduce group in router.py).
_AUX_TRACKER_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


@dataclass(frozen=True)
class ExpertLoad:
    """One step's expert-load statistics, summed over ranks and micro-batches.

    ``layers``: 1-based global layer numbers of the MoE layers; ``tokens_per_expert``
    ``[layers, experts]``: top-k choices before dropping; ``dropped``, ``entropy_sum``,
    ``tokens`` ``[layers]``; ``aux_losses``: megatron's tracked losses (mean per micro-batch,
    divided by their coefficient), name -> ``[layers]``.
    """

    layers: tuple[int, ...]
    tokens_per_expert: torch.Tensor
    dropped: torch.Tensor
    entropy_sum: torch.Tensor
    tokens: torch.Tensor
    aux_losses: dict[str, torch.Tensor]

    @property
    def load_ratio(self) -> torch.Tensor:
        """``[layers]`` max over experts / mean over experts of the tokens routed (1 = even)."""
        mean = self.tokens_per_expert.mean(dim=1)
        return self.tokens_per_expert.max(dim=1).values / mean.clamp(min=1e-12)

    @property
    def entropy(self) -> torch.Tensor:
        """``[layers]`` mean router entropy per token (nats; log(experts) = uniform)."""
        return self.entropy_sum / self.tokens.clamp(min=1)

    @property
    def dropped_fraction(self) -> torch.Tensor:
        """``[layers]`` fraction of top-k choices dropped by the capacity factor."""
        return self.dropped / self.tokens_per_expert.sum(dim=1).clamp(min=1)

    def summary(self) -> dict[str, float]:
        """The step's numbers for ``metrics.jsonl``: worst layer's load ratio, means over
        layers, the dropped fraction of all choices, and the aux losses' layer means."""
        out = {
            "moe/load_ratio_max": float(self.load_ratio.max()),
            "moe/load_ratio_mean": float(self.load_ratio.mean()),
            "moe/router_entropy": float(self.entropy.mean()),
            "moe/dropped_fraction": float(self.dropped.sum() / self.tokens_per_expert.sum()),
            "moe/tokens": float(self.tokens.mean()),  # per layer: each routes them all
        }
        out.update({f"moe/{k}": float(v.mean()) for k, v in self.aux_losses.items()})
        return out

    def per_layer(self) -> dict[str, float]:
        """Per-layer numbers for TensorBoard (``moe/layer_NN/...``)."""
        out: dict[str, float] = {}
        for i, layer in enumerate(self.layers):
            key = f"moe/layer_{layer:02d}"
            out[f"{key}/load_ratio"] = float(self.load_ratio[i])
            out[f"{key}/router_entropy"] = float(self.entropy[i])
            out[f"{key}/dropped_fraction"] = float(self.dropped_fraction[i])
            for e, n in enumerate(self.tokens_per_expert[i].tolist()):
                out[f"{key}/tokens_expert_{e:02d}"] = n
            for name, values in self.aux_losses.items():
                out[f"{key}/{name}"] = float(values[i])
        return out


class ExpertLoadMonitor:
    """Counts expert load of every MoE router of ``model`` (this rank's pipeline stage).

    Build it on every rank (also on a stage without MoE layers: :meth:`reduce` is
    collective), record inside :meth:`recording`, then :meth:`reduce` once per step.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.utils import get_attr_wrapped_model

        config = get_attr_wrapped_model(model, "config")
        if not config.num_moe_experts:
            raise ValueError("ExpertLoadMonitor needs an MoE model (config.num_moe_experts)")
        self.config = config
        self.layers = moe_layer_numbers(config.num_layers, config.moe_layer_freq)
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        lb = config.moe_router_load_balancing_type
        self.aux_names = [_AUX_TRACKER_NAMES[t] for t in _as_list(lb) if t in _AUX_TRACKER_NAMES]
        if config.moe_z_loss_coeff is not None:
            self.aux_names.append("z_loss")
        self.num_experts = config.num_moe_experts
        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        device = next(model.parameters()).device
        self.buffer = torch.zeros(
            (len(self.layers), self.num_experts + COLUMNS), dtype=torch.float64, device=device
        )
        self._recording = False
        self._handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def remove(self) -> None:
        """Detach the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count the training forwards run inside (the buffer starts from zero)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.buffer.zero_()
        clear_aux_losses_tracker()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _hook(self, router, args, output) -> None:
        if not (self._recording and router.training and torch.is_grad_enabled()):
            return
        from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

        with torch.no_grad():
            hidden = args[0]
            routing_map = output[1]
            logits = router.gating(hidden).reshape(-1, self.num_experts)
            routed = self._routed_map(router, logits, routing_map)
            padding = args[1] if len(args) > 1 else None  # [s, b] (MoELayer.route), True: pad
            if padding is not None:
                real = ~padding.reshape(-1)
                logits, routed, routing_map = logits[real], routed[real], routing_map[real]
            _, scores = compute_routing_scores_for_aux_loss(
                logits.float(), router.topk, router.score_function
            )
            row = self.buffer[self._row[router.layer_number]]
            row[: self.num_experts] += routed.sum(dim=0)
            stats = row[self.num_experts :]
            stats[DROPPED] += (routed & ~routing_map).sum()
            stats[ENTROPY] += torch.special.entr(scores.double()).sum()
            stats[TOKENS] += logits.shape[0]
            stats[CALLS] += 1

    def _routed_map(self, router, logits: torch.Tensor, routing_map: torch.Tensor):
        """``[tokens, experts]`` top-k choices before capacity dropping."""
        if self.config.moe_expert_capacity_factor is None:
            return routing_map
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        # The router's own top-k (same function, inputs and options). Under routing replay
        # the router used the replayed indices instead: a capacity factor with replay
        # counts the router's choices, not the replayed ones.
        c = self.config
        _, routed = topk_routing_with_score_function(
            logits,
            router.topk,
            use_pre_softmax=c.moe_router_pre_softmax,
            num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk,
            scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
        )
        return routed

    def reduce(self) -> ExpertLoad:
        """The step's statistics on every rank (collective over all trainer ranks)."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        tracker = get_moe_layer_wise_logging_tracker()
        aux = torch.zeros((len(self.layers), len(self.aux_names)), dtype=torch.float64)
        aux = aux.to(self.buffer.device)
        index = torch.tensor([n - 1 for n in self.layers], device=self.buffer.device)
        for j, name in enumerate(self.aux_names):
            if name in tracker:
                aux[:, j] = tracker[name]["values"].to(aux.device, torch.float64)[index]
        clear_aux_losses_tracker()
        # Ranks that see different tokens of the same layers; then the other stages' layers.
        sp = self.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        group = (
            ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
            if sp
            else ps.get_data_parallel_group(with_context_parallel=True)
        )
        total = torch.cat([self.buffer, aux], dim=1)
        total = collectives.all_reduce(total, group=group)
        total = collectives.all_reduce(total, group=ps.get_pipeline_model_parallel_group())
        total = total.cpu()  # the step's one host sync
        e = self.num_experts
        stats = total[:, e : e + COLUMNS]
        calls = stats[:, CALLS].clamp(min=1)
        aux_losses = {}
        for j, name in enumerate(self.aux_names):
            # Mean over the group's router calls; a load-balancing loss is split over the
            # ranks of its reduce group (router.py): those parts add up.
            parts = _aux_parts(name, sp, ps)
            aux_losses[name] = total[:, e + COLUMNS + j] / calls * parts
        return ExpertLoad(
            layers=tuple(self.layers),
            tokens_per_expert=total[:, :e],
            dropped=stats[:, DROPPED],
            entropy_sum=stats[:, ENTROPY],
            tokens=stats[:, TOKENS],
            aux_losses=aux_losses,
        )


def _aux_parts(name: str, sp: bool, ps) -> int:
    """Ranks of the reduced group over which megatron splits one value of tracker ``name``."""
    tp_cp = (ps.get_tensor_model_parallel_world_size() if sp else 1) * (
        ps.get_context_parallel_world_size()
    )
    if name == "global_load_balancing_loss":
        return tp_cp * ps.get_data_parallel_world_size()
    if name in ("load_balancing_loss", "seq_load_balancing_loss"):
        return tp_cp
    return 1  # z_loss: each rank's value is a mean over its own tokens


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def moe_layer_numbers(num_layers: int, moe_layer_freq) -> list[int]:
    """1-based numbers of the MoE layers (megatron's ``moe_layer_freq``: an int N = every
    Nth layer from the first, or a 0/1 list)."""
    if isinstance(moe_layer_freq, int):
        pattern = [int(i % moe_layer_freq == 0) for i in range(num_layers)]
    else:
        pattern = list(moe_layer_freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def expert_load_monitor(model: torch.nn.Module) -> ExpertLoadMonitor | None:
    """The monitor of ``model`` (made on first use, kept on the model), None if dense."""
    from megatron.core.utils import get_attr_wrapped_model

    monitor = getattr(model, "_expert_load_monitor", None)
    if monitor is None and get_attr_wrapped_model(model, "config").num_moe_experts:
        monitor = ExpertLoadMonitor(model)
        model._expert_load_monitor = monitor
    return monitor

"""Routing replay (R3): the policy forward routes every token to the experts the generator used.

The generator's routing travels with each sample (``Sample.routed_experts [P, layers, topk]``,
``megatron_rl.rollout.engine.routing``). In a micro-batch it becomes ``routing [b, s, layers, topk]``
(:func:`routing_tensor`). Before each forward, :func:`set_routing` hands every MoE router of
this rank its slice through megatron-core's own replay (``moe_enable_routing_replay``,
``megatron.core.transformer.moe.router_replay``): the router takes the given top-k indices
and gathers their scores, so gradients still flow into the router through the probabilities.

Parallel layouts: the rows are per global layer; a router knows its global layer
(``layer_number``, pipeline offset included), so a pipeline stage takes its layers. Routing
runs on a rank's own tokens before any expert-parallel dispatch, with global expert ids: EP
needs nothing. Megatron's router sees a ``[s, b]`` token order; with sequence parallelism a
tensor-parallel rank holds the sequence chunk ``tp_rank`` of ``s / tp`` positions.

Activation recompute re-runs the router in the backward pass; with one pipeline stage the
forward and backward of a micro-batch are adjacent, so the targets set for its forward are
still in place (``REPLAY_FORWARD``). Under a pipeline schedule they would not be: that
combination is refused at config load.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

UNROUTED = -1  # a position the generator did not route (see routing_tensor)


def routers(model) -> list[tuple[int, object]]:
    """``(global layer index, TopKRouter)`` of every MoE router of this rank's ``model``."""
    from megatron.core.transformer.moe.router import TopKRouter

    found = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            found.append((module.layer_number - 1, module))
    return found


def enable(model) -> int:
    """Give every router of ``model`` megatron's ``RouterReplay`` (what a TransformerConfig with
    ``moe_enable_routing_replay=True`` builds); returns the number of routers."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    found = routers(model)
    if not found:
        raise ValueError("algorithm.routing_replay: the model has no MoE layers to replay")
    for _, router in found:
        router.config.moe_enable_routing_replay = True
        if router.router_replay is None:
            router.router_replay = RouterReplay()
    return len(found)


def is_enabled(model) -> bool:
    return any(r.router_replay is not None for _, r in routers(model))


def routing_tensor(
    rows: Sequence[np.ndarray | None], length: int, shape: tuple[int, int]
) -> torch.Tensor:
    """``[b, length, layers, topk]`` int64 from each sequence's rows ``[P_i, layers, topk]``.

    Positions without a row (a sequence's last token, which the generator never processed,
    and right padding) hold :data:`UNROUTED`; :func:`set_routing` spreads them over the
    experts (nothing before them depends on them)."""
    out = torch.full((len(rows), length, *shape), UNROUTED, dtype=torch.long)
    for i, r in enumerate(rows):
        if r is None:
            raise ValueError(
                "algorithm.routing_replay: a sample has no routed experts (the generator "
                "did not return them: rollout.return_routed_experts)"
            )
        if tuple(r.shape[1:]) != shape:
            raise ValueError(
                f"routed experts of shape {tuple(r.shape)} do not fit the model's "
                f"[positions, {shape[0]} layers, top-{shape[1]}]"
            )
        n = min(len(r), length)
        out[i, :n] = torch.from_numpy(np.ascontiguousarray(r[:n]).astype(np.int64))
    return out


def local_indices(routing: torch.Tensor, layer: int, sequence_parallel: bool) -> torch.Tensor:
    """The top-k indices ``[tokens, topk]`` that this rank's router of global ``layer`` sees for
    ``routing [b, s, layers, topk]``, in megatron's ``[s, b]`` token order (the sequence-parallel
    chunk of this tensor-parallel rank when sequence parallelism is on)."""
    from megatron.core import parallel_state

    idx = routing[:, :, layer]  # [b, s, k]
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if sequence_parallel and tp > 1:
        s = idx.shape[1]
        if s % tp:  # forward_logits pads the sequence the same way
            idx = torch.nn.functional.pad(idx, (0, 0, 0, tp - s % tp), value=UNROUTED)
        chunk = idx.shape[1] // tp
        rank = parallel_state.get_tensor_model_parallel_rank()
        idx = idx[:, rank * chunk : (rank + 1) * chunk]
    return idx.transpose(0, 1).reshape(-1, idx.shape[-1])


def spread_unrouted(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``indices [tokens, topk]`` with the :data:`UNROUTED` choices given experts in turn
    (the i-th such choice of this rank: expert ``i % num_experts``), so the padding of a
    micro-batch spreads evenly over the experts and their expert-parallel ranks instead of
    landing on expert 0 in every layer; a token's top-k stay distinct (topk <= experts)."""
    unrouted = indices == UNROUTED
    slot = torch.cumsum(unrouted.reshape(-1), 0).reshape(indices.shape) - 1
    return torch.where(unrouted, slot % num_experts, indices)


def require_routing(samples: Sequence) -> None:
    """Raise unless every sample (``TrainSample``) carries the generator's routed experts."""
    missing = sum(s.routed_experts is None for s in samples)
    if missing:
        raise ValueError(
            f"algorithm.routing_replay: {missing} of {len(samples)} samples have no routed "
            "experts (the generator did not return them: rollout.return_routed_experts)"
        )


def set_routing(model, routing: torch.Tensor | None) -> None:
    """Replay ``routing [b, s, layers, topk]`` in the next forward of ``model`` (None: route
    freely, e.g. a data-parallel rank's empty micro-batch)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for layer, router in routers(model):
        replay = router.router_replay
        if replay is None:
            continue
        replay.clear_indices()
        if routing is None:
            replay.clear_router_replay_action()
            continue
        indices = local_indices(routing, layer, router.config.sequence_parallel)
        indices = spread_unrouted(indices, router.config.num_moe_experts)
        replay.set_target_indices(indices.to(router.weight.device))
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


@contextlib.contextmanager
def replay_session(model) -> Iterator[None]:
    """Routers route freely again after the block (a forward-backward over micro-batches)."""
    try:
        yield
    finally:
        for _, router in routers(model):
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

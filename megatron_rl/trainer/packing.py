"""Packed micro-batches: whole sequences back to back in one row (``batch.pack``).

A padded micro-batch (``batch.make_micro_batches``) is ``[b, s]``, each row right-padded to
the micro-batch's longest sequence; a packed one is ``[1, T]``: its sequences one after the
other with no padding between them, and ``cu_seqlens`` (megatron-core's ``PackedSeqParams``,
the THD layout) says where each starts. Positions restart at 0 in each sequence and no token
attends across a boundary (Transformer Engine's ``thd`` attention on GPU; on CPU the SDPA core
attention of ``models.attention`` attends each sequence alone), so a sequence's logits are
those it has alone.

Micro-batches are filled to a token budget first-fit decreasing: each sequence, longest first,
goes to the first micro-batch it still fits (a new one otherwise), so the budget is filled to
the last few percent instead of to ``b x longest``; ``tools/bench_packing.py`` measures both.
The loss reads the same flat per-token tensors in the same order as the padded layout (``select``
marks, row-major, the positions that predict a response token; a sequence's last position,
which would predict the next sequence's first token, is never selected).

The total length is rounded up to the ``multiple`` a micro-batch needs (FP8 alignment,
sequence parallelism) by one more segment of padding at the end, its own "sequence" in
``cu_seqlens``, so it attends only to itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_rl.models.logprobs import packed_positions  # noqa: F401 (re-exported)
from megatron_rl.trainer.batch import (
    MicroBatch,
    TrainSample,
    flat_response_tensors,
    padded_length,
    plan_micro_batches,
)


def plan_packed(lengths: Sequence[int], tokens: int) -> list[list[int]]:
    """Which samples form each packed micro-batch (indices into ``lengths``): first-fit
    decreasing into bins of ``tokens`` (their total length), longest first; a sequence longer
    than ``tokens`` gets a micro-batch of its own. Deterministic (ties keep their order)."""
    if tokens < 1:
        raise ValueError(f"plan_packed: tokens {tokens!r} below 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        for b, total in enumerate(used):
            if total + n <= tokens:
                bins[b].append(i)
                used[b] += n
                break
        else:
            bins.append([i])
            used.append(n)
    return bins


def cu_seqlens_of(lengths: Sequence[int], multiple: int = 1) -> torch.Tensor:
    """``[n + 1]`` int32 cumulative starts of sequences of ``lengths`` packed back to back,
    with one more segment when the total must be padded up to a ``multiple``."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    total = padded_length(bounds[-1], multiple)
    if total > bounds[-1]:
        bounds.append(total)
    return torch.tensor(bounds, dtype=torch.int32)


def packed_micro_batch(
    samples: Sequence[TrainSample],
    advantages: torch.Tensor,
    keep: torch.Tensor,
    ids: Sequence[int],
    monitor_version: int | None = None,
    pad_id: int = 0,
    multiple: int = 1,
) -> MicroBatch:
    """One ``[1, T]`` micro-batch of ``samples`` back to back (``T`` rounded up to a
    ``multiple``), with the flat per-token tensors of :func:`~batch.flat_response_tensors`."""
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
    cu = cu_seqlens_of(lengths, multiple)
    total = int(cu[-1])
    tokens = torch.full((1, total), pad_id, dtype=torch.long)
    select = torch.zeros((1, max(total - 1, 0)), dtype=torch.bool)
    for s, start in zip(samples, cu.tolist()):
        seq = list(s.prompt_tokens) + list(s.response_tokens)
        tokens[0, start : start + len(seq)] = torch.tensor(seq)
        # position j predicts token j + 1: the response tokens of this sequence
        select[0, start + len(s.prompt_tokens) - 1 : start + len(seq) - 1] = True
    flat = flat_response_tensors(samples, advantages, keep, ids, monitor_version)
    padding = torch.arange(total) >= sum(lengths)
    return MicroBatch(
        tokens,
        select,
        flat["gen"],
        flat["adv"],
        flat["mask"],
        flat["sid"],
        flat["pid"],
        flat["monitor"],
        _packed_routing(samples, total),
        padding[None],
        cu,
        old_logprobs=flat.get("old"),
    )


def make_packed_micro_batches(
    samples: Sequence[TrainSample],
    advantages: torch.Tensor,
    keep: torch.Tensor,
    micro_batch_size: int | None = None,
    pad_id: int = 0,
    ids: Sequence[int] | None = None,
    monitor_version: int | None = None,
    multiple: int = 1,
    micro_batch_tokens: int | None = None,
) -> list[MicroBatch]:
    """Packed micro-batches of ``samples``: ``micro_batch_tokens`` filled first-fit decreasing
    (:func:`plan_packed`), or ``micro_batch_size`` sequences each (the padded plan's groups);
    the arguments of :func:`~batch.make_micro_batches`."""
    ids = list(range(len(samples))) if ids is None else list(ids)
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
    if micro_batch_tokens is not None and micro_batch_size is None:
        # the total is rounded up to the multiple after: keep that inside the budget
        plan = plan_packed(lengths, max(micro_batch_tokens - (multiple - 1), 1))
    else:
        plan = plan_micro_batches(lengths, micro_batch_size, micro_batch_tokens, multiple)
    return [
        packed_micro_batch(
            [samples[i] for i in part],
            advantages[part],
            keep[part],
            [ids[i] for i in part],
            monitor_version,
            pad_id,
            multiple,
        )
        for part in plan
    ]


def _packed_routing(samples: Sequence[TrainSample], total: int) -> torch.Tensor | None:
    """``[1, total, layers, topk]``: each sample's generator routing in its packed span (None
    without any)."""
    rows = [s.routed_experts for s in samples]
    known = [r for r in rows if r is not None]
    if not known:
        return None
    from megatron_rl.trainer.routing_replay import UNROUTED, routing_tensor

    shape = tuple(known[0].shape[1:])
    parts = [
        routing_tensor([r], len(s.prompt_tokens) + len(s.response_tokens), shape)
        for s, r in zip(samples, rows)
    ]
    used = sum(p.shape[1] for p in parts)
    parts.append(torch.full((1, total - used, *shape), UNROUTED, dtype=torch.long))
    return torch.cat(parts, dim=1)

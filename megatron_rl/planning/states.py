"""Weights, gradients and optimizer states of one trainer rank, as megatron-core 0.16.1 lays
them out (no torch import).

The trainer (``megatron_rl.trainer.optim``) wraps the model in megatron's
``DistributedDataParallel`` with ``grad_reduce_in_fp32=True`` and trains it with
``get_megatron_optimizer`` (Adam). What that allocates, read from megatron-core's sources:

- ``distributed/param_and_grad_buffer.py`` (``_ParamAndGradBuffer``): one buffer per (param
  dtype, grad dtype) among the dense parameters, and one per pair among the routed experts'
  parameters when expert parallelism is on (reduced over the expert-data-parallel group). All
  our parameters have the model's dtype (the FP32 head upcasts its weight on the fly), so
  that is one dense buffer and, under EP, one expert buffer.
  Parameters are placed in reverse order; a bucket closes once it holds ``bucket_size``
  elements (``max(4e7, 1e6 x DP)`` with overlapped reduction, else one bucket; pipeline
  stages after the first: one bucket). With the distributed optimizer every parameter starts
  at a multiple of 64 elements and every bucket is padded to a multiple of lcm(DP, 128), and
  the parameters themselves move into a ``param_data`` buffer of the same (padded) size.
  Gradients live in ``grad_data``: float32 here.
- ``optimizer/distrib_optimizer.py``: each bucket is cut into DP equal shards; for the part of
  each parameter in its shard a rank keeps an fp32 main copy (16-bit parameters only; fp32
  parameters are used in place) and Adam's two fp32 moments.
- Without the distributed optimizer (CPU): ``FP32Optimizer`` (fp32 parameters) or
  ``Float16OptimizerWithFloat16Params`` (fp32 main copy of every 16-bit parameter), moments for
  every parameter.
- torch's ``AdamW`` (megatron's fallback without Transformer Engine / Apex, i.e. on CPU) adds
  a 4-byte ``step`` tensor per parameter tensor; TE's ``FusedAdam`` (GPU) keeps the step in
  the param group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_rl.planning.shapes import ParamSpec

FP32 = 4
ADAM_MOMENTS = 2


def default_bucket_size(dp: int, overlap_grad_reduce: bool, stage: int) -> int | None:
    """megatron's DDP bucket size in elements (``DistributedDataParallel.__init__``)."""
    if not overlap_grad_reduce or stage > 0:
        return None
    return max(40_000_000, 1_000_000 * dp)


@dataclass(frozen=True)
class BufferLayout:
    """One ``_ParamAndGradBuffer``: where each parameter sits and the buckets.

    ``ranges``: parameter name -> (start, end) element indices; ``buckets``: (start, end) of
    each bucket, padding included; ``numel``: the buffer's size, padding included.
    """

    param_bytes: int
    grad_bytes: int
    dp: int
    params: tuple[ParamSpec, ...]
    ranges: dict[str, tuple[int, int]]
    buckets: tuple[tuple[int, int], ...]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    def shard_numel(self, rank: int) -> dict[str, int]:
        """Elements of each parameter in data-parallel rank ``rank``'s shard of every bucket
        (the distributed optimizer's ``_build_model_gbuf_range``); parameters with none left
        out."""
        out: dict[str, int] = {}
        for start, end in self.buckets:
            size = (end - start) // self.dp
            lo, hi = start + rank * size, start + (rank + 1) * size
            for p in self.params:
                a, b = self.ranges[p.name]
                if a >= start and b <= end:
                    n = min(b, hi) - max(a, lo)
                    if n > 0:
                        out[p.name] = out.get(p.name, 0) + n
        return out

    def owned_per_rank(self) -> list[tuple[int, int]]:
        """(elements, parameter tensors) of each data-parallel rank's shards: the parameter
        elements inside them (padding excluded) and how many parameters reach into them."""
        spans = np.array(sorted(self.ranges[p.name] for p in self.params), dtype=np.int64)
        lows, highs = spans[:, 0], spans[:, 1]
        cumulative = np.concatenate([[0], np.cumsum(highs - lows)])
        buckets = np.array(self.buckets, dtype=np.int64)
        size = (buckets[:, 1] - buckets[:, 0]) // self.dp
        # shard boundaries [bucket, rank 0..dp]
        edges = buckets[:, :1] + size[:, None] * np.arange(self.dp + 1)[None, :]
        k = np.searchsorted(lows, edges, side="right")  # parameters starting at or below
        prev = np.maximum(k - 1, 0)
        covered = np.where(k > 0, cumulative[prev] + np.minimum(highs[prev], edges) - lows[prev], 0)
        owned = covered[:, 1:] - covered[:, :-1]  # [bucket, rank]
        started = np.searchsorted(lows, edges[:, 1:], side="left")
        ended = np.searchsorted(highs, edges[:, :-1], side="right")
        counts = np.where(owned > 0, started - ended, 0)
        return [(int(n), int(c)) for n, c in zip(owned.sum(0), counts.sum(0), strict=True)]


def _pad(n: int, divisor: int) -> int:
    return int(math.ceil(n / divisor) * divisor)


def buffer_layout(
    params: Sequence[ParamSpec],
    param_bytes: int,
    grad_bytes: int,
    dp: int,
    distributed: bool,
    bucket_size: int | None,
) -> BufferLayout:
    """The layout megatron gives ``params`` (in ``named_parameters()`` order) in one buffer."""
    ranges: dict[str, tuple[int, int]] = {}
    buckets: list[tuple[int, int]] = []
    bucket_start, start, in_bucket = 0, 0, 0
    divisor = math.lcm(dp, 128)

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        padded = _pad(end, divisor) if distributed else end
        buckets.append((bucket_start, padded))
        bucket_start, in_bucket = padded, 0
        return padded

    end = 0
    for p in reversed(params):
        if distributed:
            start = _pad(start, 64)
        own_bucket = p.shared and distributed
        if own_bucket and in_bucket:
            start = close(start)
        end = start + p.numel
        ranges[p.name] = (start, end)
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return BufferLayout(param_bytes, grad_bytes, dp, tuple(params), ranges, tuple(buckets))


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one rank's model state.

    ``params``: the weights (in ``param_data`` buffers under the distributed optimizer, else
    the parameters' own tensors); ``grads``: the DDP gradient buffers; ``main_params``: fp32
    master copies; ``moments``: Adam's exp_avg and exp_avg_sq; ``steps``: torch AdamW's
    per-tensor step counters.
    """

    params: int
    grads: int
    main_params: int
    moments: int
    steps: int
    buffers: tuple[BufferLayout, ...] = field(default=(), repr=False, compare=False)

    @property
    def optimizer(self) -> int:
        return self.main_params + self.moments + self.steps

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def state_bytes(
    params: Sequence[ParamSpec],
    model_bytes: int,
    dp: int,
    expert_dp: int,
    distributed: bool,
    overlap_grad_reduce: bool,
    stage: int = 0,
    dp_rank: int | None = None,
    step_tensors: bool = False,
) -> StateBytes:
    """Model-state bytes of one rank holding ``params`` (``rank_parameters``).

    ``model_bytes``: bytes per element of the model's dtype; ``dp`` / ``expert_dp``: sizes of
    the data-parallel groups of dense and routed-expert parameters. ``dp_rank``: the rank whose
    optimizer shard is counted (ranks differ by padding); None: the largest shard.
    ``step_tensors``: torch AdamW's per-tensor ``step`` (CPU); TE FusedAdam has none (GPU).
    """
    bucket_size = default_bucket_size(dp, overlap_grad_reduce, stage)
    groups: dict[bool, list[ParamSpec]] = {}
    for p in params:  # dense, then routed experts (one dtype: the model's)
        groups.setdefault(p.expert, []).append(p)
    buffers = tuple(
        buffer_layout(
            group, model_bytes, FP32, expert_dp if expert else dp, distributed, bucket_size
        )
        for expert, group in sorted(groups.items())
    )
    grads = sum(b.numel * b.grad_bytes for b in buffers)
    if distributed:
        weights = sum(b.numel * b.param_bytes for b in buffers)
    else:
        weights = sum(p.numel * model_bytes for p in params)

    owned = [
        b.owned_per_rank() if distributed else [(sum(p.numel for p in b.params), len(b.params))]
        for b in buffers
    ]

    def optimizer(rank: int) -> tuple[int, int, int]:
        main = moments = steps = 0
        for b, per_rank in zip(buffers, owned, strict=True):
            n, count = per_rank[rank % len(per_rank)]
            moments += ADAM_MOMENTS * FP32 * n
            main += FP32 * n if b.param_bytes < FP32 else 0
            steps += FP32 * count if step_tensors else 0
        return main, moments, steps

    if dp_rank is not None:
        main, moments, steps = optimizer(dp_rank)
    else:
        main, moments, steps = max((optimizer(r) for r in range(max(dp, expert_dp))), key=sum)
    return StateBytes(weights, grads, main, moments, steps, buffers)

"""Push a Megatron model's weights into the generator pool (called on every trainer rank)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.conversion.weight_stream import DEFAULT_BUCKET_BYTES, iter_hf_weights
from megatron_rl.rollout.samples import PushStats


def push_megatron_weights(
    pool,
    model,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    reweigh: bool = False,
    between: Callable[[], None] | None = None,
) -> PushStats | None:
    """Stream ``model``'s weights (HF names, full tensors) into ``pool``; ``reweigh``: only
    into the restarted engines that wait for them, as the current version
    (``GeneratorPool.reweigh``), else into every engine as the next version.

    Every rank of the trainer calls this (the TP / EP / PP gathers are collectives); the rank
    that holds the pool (the stream's sender: TP / EP / DP rank 0 of the first pipeline stage)
    passes it, the others pass None. Returns the push statistics on the sender, else None.
    ``between``: see ``GeneratorPool.push_weights`` (not used by a reweigh).
    """
    from megatron_rl.rollout.weights import m2n_ranks

    if (ranks := m2n_ranks.current()) is not None:  # nccl_m2n: own shards, no HF stream
        return ranks.push(pool, reweigh, between)
    buckets = iter_hf_weights(model, bucket_bytes=bucket_bytes, dtype=dtype)
    if pool is None:
        for bucket in buckets:
            raise RuntimeError(
                f"this rank yields weights ({bucket[0][0]} ...) but has no generator pool: "
                "create the pool on the stream's sender rank"
            )
        return None
    return pool.reweigh(buckets) if reweigh else pool.push_weights(buckets, between=between)

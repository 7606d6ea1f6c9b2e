"""Push a Megatron model's weights into the generator pool (called on every trainer rank)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch

from megatron_rl.conversion.weight_stream import WeightBucket, iter_hf_weights
from megatron_rl.rollout.samples import PushStats
from megatron_rl.rollout.weights.buckets import ReadyBucket

_END = object()  # the stream's end, in the prefetch queue


def push_megatron_weights(
    pool,
    model,
    bucket_bytes: int | None = None,
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
    ``bucket_bytes``: default the pool's ``rollout.weight_bucket_mb`` (platform-dependent when
    unset), else this platform's default. On the sender the next bucket is gathered and built
    while the pool sends the current one (:func:`prefetched`). ``between``: see
    ``GeneratorPool.push_weights`` (not used by a reweigh).
    """
    from megatron_rl.rollout.weights import m2n_ranks

    if (ranks := m2n_ranks.current()) is not None:  # nccl_m2n: own shards, no HF stream
        return ranks.push(pool, reweigh, between)
    if bucket_bytes is None:
        from megatron_rl.rollout.config import RolloutConfig

        config = pool.config if pool is not None else RolloutConfig()
        bucket_bytes = config.weight_bucket_bytes
    buckets = iter_hf_weights(model, bucket_bytes=bucket_bytes, dtype=dtype)
    if pool is None:
        with torch.no_grad():
            for bucket in buckets:
                raise RuntimeError(
                    f"this rank yields weights ({bucket[0][0]} ...) but has no generator pool: "
                    "create the pool on the stream's sender rank"
                )
        return None
    buckets = prefetched(buckets)
    try:
        return pool.reweigh(buckets) if reweigh else pool.push_weights(buckets, between=between)
    finally:
        buckets.close()


def prefetched(buckets: Iterator[WeightBucket], alive: int = 2) -> Iterator[WeightBucket]:
    """``buckets`` in order, each built by a helper thread while the caller still sends the
    previous one (gathers, name mapping and copies of bucket n+1 overlap the transport of
    bucket n).

    Memory bound: at most ``alive`` buckets are built and not yet given up by the caller, who
    gives bucket n up by asking for bucket n+1: the helper holds a permit per bucket (a
    semaphore of ``alive``), taken before it starts building one and returned when the caller
    asks for the next. With the default 2: the bucket being sent and the one being built.

    The helper runs the stream's collectives on this rank (the other ranks run theirs on
    their main threads: the order per rank is the stream's own); it runs on this thread's
    device, without autograd. Closing the returned generator (or an error in the caller)
    stops the helper before it starts another bucket and closes ``buckets``; an error in the
    stream is raised here.

    The helper enqueues the bucket's device work (gathers, slicing, copies) on its own current
    CUDA stream; each bucket comes as a :class:`ReadyBucket` whose ``ready`` event is recorded
    there once it is built, for a sender that reads it on another stream (vLLM's packed
    broadcast runs on side streams of its own) to wait on.
    """
    if alive < 1:
        raise ValueError(f"prefetched: alive must be >= 1, got {alive}")
    from megatron_rl.platform import get_platform, record_event, set_thread_device

    device = get_platform().torch_device()
    permits = threading.Semaphore(alive)
    ready: queue.Queue = queue.Queue()
    stop = threading.Event()

    def build() -> None:
        set_thread_device(device)
        try:
            with torch.no_grad():
                while permits.acquire() and not stop.is_set():
                    bucket = next(buckets, _END)
                    if bucket is _END:
                        ready.put(bucket)
                        return
                    bucket = ReadyBucket(bucket)
                    bucket.ready = record_event()  # after the bucket's work on this stream
                    ready.put(bucket)
        except BaseException as err:  # noqa: BLE001 - raised on the caller's thread
            ready.put(err)
        finally:
            buckets.close()

    helper = threading.Thread(target=build, name="weight-prefetch", daemon=True)
    helper.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            del item  # given up: the helper may build the bucket after the next one
            permits.release()
    finally:
        stop.set()
        permits.release()  # wake a helper waiting for a permit: it sees ``stop`` and ends

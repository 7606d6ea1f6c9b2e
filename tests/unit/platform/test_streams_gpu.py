"""The stream ordering of a weight push on a real GPU (issue 36, 2 and 13): a bucket built on
one stream (the prefetch thread's) and read on another (vLLM's packing side stream) is read
only after it is written, and its memory is not reused while the reading stream still has
work queued. Real ``torch.cuda`` streams, events and caching allocator; one GPU, no vLLM
(the lent H200 runs these: tools/gpu_check.sh). Skipped without CUDA (conftest)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

SPIN = 200_000_000  # torch.cuda._sleep cycles: ~0.1 s on an H200's ~1.9 GHz clock
N = 1 << 20


def _late_bucket(value: float) -> list[tuple[str, torch.Tensor]]:
    """A bucket whose tensor is -1 at first and ``value`` only after a long kernel, all on
    the calling thread's current stream (as the prefetch thread's gathers and copies)."""
    tensor = torch.full((N,), -1.0, device="cuda")
    torch.cuda._sleep(SPIN)
    tensor.fill_(value)
    return [("w", tensor)]


def test_a_side_stream_that_waits_on_the_buckets_event_reads_its_values():
    """``prefetched`` builds each bucket on its helper thread's stream and records
    ``ready`` there; a side stream (as vLLM's packing) that waits on it reads the final
    values; one that does not wait reads them before the producer wrote them."""
    from megatron_rl import platform
    from megatron_rl.rollout.weights.push import prefetched

    def buckets():
        for value in (1.0, 2.0, 3.0):
            yield _late_bucket(value)

    side = torch.cuda.Stream()
    for value, bucket in zip((1.0, 2.0, 3.0), prefetched(buckets())):
        assert bucket.ready is not None
        with torch.cuda.stream(side):
            platform.wait_event(bucket.ready)
            tensor = bucket[0][1]
            platform.keep_for_stream(tensor)
            packed = torch.cat([tensor.view(-1)])  # what vLLM's pack_tensors does
        side.synchronize()
        assert torch.equal(packed, torch.full_like(packed, value))
    # the hazard is real here: without the wait, the side stream reads too early
    late = _late_bucket(4.0)[0][1]
    with torch.cuda.stream(side):
        early = torch.cat([late.view(-1)])
    side.synchronize()
    assert not torch.equal(early, torch.full_like(early, 4.0))


def test_keep_for_stream_keeps_a_freed_tensor_from_reuse_until_the_reader_is_done():
    """The caching allocator hands a freed block straight back to its own stream; once the
    tensor is marked as read by another stream (``record_stream``), not before that
    stream's queued work is done."""
    from megatron_rl import platform

    # A size of its own above 20 MiB: a segment of exactly its (2 MiB-rounded) size, which no
    # other free block matches, so a free block of it is the one an allocation gets back.
    size = 37 * 2**20 // 4
    first = torch.empty(size, device="cuda")
    address = first.data_ptr()
    del first
    assert torch.empty(size, device="cuda").data_ptr() == address  # reused at once

    tensor = torch.ones(size, device="cuda")
    address = tensor.data_ptr()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)  # the reader's queued work
        platform.keep_for_stream(tensor)
        doubled = tensor * 2
    del tensor
    again = torch.empty(size, device="cuda")
    assert again.data_ptr() != address  # the reader still has work queued
    side.synchronize()
    assert torch.equal(doubled, torch.full_like(doubled, 2.0))

"""run_local_ranks' rendezvous: a port taken between its pick and rank 0's listen (another
test worker, another job on the node) is retried on a fresh port, not raised."""

from __future__ import annotations

import socket

import pytest

from megatron_rl.platform import parallel


@pytest.fixture
def taken_port():
    """A port some other process listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.timeout(180)
def test_taken_port_is_retried(monkeypatch, taken_port):
    from support.mp_workers import rendezvous_worker

    picks = []
    real_free_port = parallel.free_port

    def first_taken() -> int:
        port = taken_port if not picks else real_free_port()
        picks.append(port)
        return port

    monkeypatch.setattr(parallel, "free_port", first_taken)
    results = parallel.run_local_ranks(rendezvous_worker, 2, 10)
    assert results == [(0, 21), (1, 21)]  # (10 + 0) + (10 + 1), seen by both ranks
    assert picks[0] == taken_port and len(picks) == 2


@pytest.mark.timeout(180)
def test_other_failures_are_not_retried(monkeypatch):
    """A rank that fails for any other reason fails the call at once, with its traceback."""
    from support.mp_workers import rendezvous_worker
    from torch.multiprocessing import ProcessRaisedException

    picks = []
    real_free_port = parallel.free_port
    monkeypatch.setattr(parallel, "free_port", lambda: picks.append(1) or real_free_port())
    with pytest.raises(ProcessRaisedException, match="TypeError"):
        parallel.run_local_ranks(rendezvous_worker, 2, "not a number")
    assert len(picks) == 1

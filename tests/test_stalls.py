"""Stalls become restarts (issue 30, section 3): an engine process that is alive but answers
nothing (SIGSTOP) is killed and restarted like a dead one, its requests resubmitted."""

from __future__ import annotations

import logging
import os
import signal
import time
from types import SimpleNamespace

import pytest

from megatron_rl.rollout import pool as pool_module
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import Alive


def test_engine_stall_timeout_is_checked():
    with pytest.raises(ValueError, match="engine_stall_timeout must be >= 0"):
        RolloutConfig(engine_stall_timeout=-1).validate()
    RolloutConfig(engine_stall_timeout=0).validate()  # 0: off


@pytest.fixture
def beating_pool(tmp_path, monkeypatch):
    """The real pool over fake engine "processes" on real pipes (test_rollout_elastic's)."""
    from test_rollout_elastic import FakeEngines

    fakes = FakeEngines(tmp_path)
    hf = SimpleNamespace(vocab_size=100, eos_token_id=2)
    monkeypatch.setattr(pool_module, "_text_config", lambda hf_dir: hf)
    monkeypatch.setattr(pool_module, "engine_launcher", lambda hf_dir, config, settings: fakes)
    config = RolloutConfig(
        engines=2, placement="subprocess", samples_per_prompt=2, engine_stall_timeout=1.0
    )
    pool = pool_module.GeneratorPool("unused", config)
    yield pool, fakes
    pool.close()


def _beat_for(pool, fakes, seconds: float) -> None:
    """Both engines beat every 0.2 s for ``seconds`` (no step under way); the pool polls."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for index, writer in fakes.writers.items():
            writer.put(Alive(index, 0.0))
        pool.poll(timeout=0.2)


def test_an_engine_that_beats_is_never_stalled_however_long_it_is_quiet(beating_pool):
    """Beats alone (no samples, e.g. a long weight load or an idle wait) for 3x the timeout:
    no restart."""
    pool, fakes = beating_pool
    pool.submit([[10, 11]], seeds=[1])
    _beat_for(pool, fakes, 3.0)
    assert pool.restarts == 0 and fakes.spawned == [0, 1]


def test_silence_or_one_endless_step_counts_as_a_stall(beating_pool, caplog):
    """Engine 1 beats but reports one step under way for longer than the timeout (a frozen
    worker); engine 0 goes silent after its first beats (SIGSTOP): both are restarted,
    and the requests they held are resubmitted."""
    pool, fakes = beating_pool
    pool.submit([[10, 11], [12]], seeds=[1, 2])
    held = {e.index: dict(e.specs) for e in pool._engines}
    with caplog.at_level(logging.WARNING, logger=pool_module.__name__):
        start = time.monotonic()
        fakes.writers[0].put(Alive(0, 0.0))  # engine 0 beats once, then falls silent
        fakes.writers[1].put(Alive(1, 5.0))  # engine 1: one step of 5 s > 1 s
        pool.poll(timeout=0.5)
        assert fakes.spawned == [0, 1, 1]
        assert "vLLM engine 1 (pid -1) has been in one engine step for 5 s" in caplog.text
        stopped = fakes.writers.pop(0)  # engine 0 says nothing from now on
        while pool.restarts < 2:
            assert time.monotonic() - start < 5, "the silent engine was never restarted"
            fakes.writers[1].put(Alive(1, 0.0))
            pool.poll(timeout=0.2)
    assert 1.0 < time.monotonic() - start < 3.0  # from its beat: the timeout, plus a poll
    assert fakes.spawned == [0, 1, 1, 0]
    assert "vLLM engine 0 (pid -1) sent nothing for 1 s" in caplog.text
    assert "rollout.engine_stall_timeout 1 s): stalled" in caplog.text
    resubmitted = {k for e in pool._engines for k in e.specs}
    assert resubmitted == {k for specs in held.values() for k in specs}
    stopped._conn.close()


@pytest.mark.timeout(600)  # two engine starts (~60 s each here) and a 20 s stall
def test_a_stopped_engine_process_is_killed_restarted_and_its_samples_come_back(
    tiny_hf_dirs, caplog
):
    """A real engine process SIGSTOPped with requests in flight: the pool notices within
    rollout.engine_stall_timeout (plus a beat), kills it, restarts it, resubmits; every
    sample comes back. Before the stall check the pool waited forever."""
    from megatron_rl.rollout.pool import GeneratorPool

    timeout = 20.0
    config = RolloutConfig(
        placement="subprocess",
        max_tokens=16,
        samples_per_prompt=2,
        dtype="float32",
        engine_stall_timeout=timeout,
    )
    with GeneratorPool(tiny_hf_dirs["tiny-llama"], config) as pool:
        assert pool.generate([[1, 2, 3]])  # up and generating
        pid = pool._engines[0].handle.pid
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        indices = pool.submit([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seeds=[1, 2, 3])
        got = []
        with caplog.at_level(logging.WARNING, logger=pool_module.__name__):
            while pool.restarts == 0:
                assert time.monotonic() - stopped < timeout + 30, "the stall went unnoticed"
                got += pool.poll(timeout=1.0)
        noticed = time.monotonic() - stopped
        assert timeout < noticed < timeout + 15  # the timeout, plus a beat and a poll
        assert f"vLLM engine 0 (pid {pid}) sent nothing for" in caplog.text
        with pytest.raises(ProcessLookupError):  # killed (and reaped)
            os.kill(pid, 0)
        assert pool._engines[0].handle.pid != pid
        deadline = time.monotonic() + 300
        while pool.in_flight:
            assert time.monotonic() < deadline, "the resubmitted requests never came back"
            got += pool.poll(timeout=1.0)
    want = sorted((i, j) for i in indices for j in range(2))
    assert sorted((s.prompt_index, s.sample_index) for s in got) == want
    assert all(len(s.response_ids) > 0 for s in got)

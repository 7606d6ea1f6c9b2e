"""Multi-rank trainers (gloo ranks spawned here) pushing into an engine process:
``megatron-rl check-parity --tp 2`` on the tiny dense Llama and ``--tp 2 --ep 2`` on the tiny
Llama-4 (attention split over 2 TP ranks, experts over 2 EP ranks).
After the push vLLM's log-probs equal Megatron's (fp32); before it they differ."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_rl.rollout import parity


def check(hf_dir: str, tp: int, ep: int, capsys) -> dict:
    parser = argparse.ArgumentParser()
    parity.add_arguments(parser)
    args = parser.parse_args([hf_dir, "--tp", str(tp), "--ep", str(ep), "--json"])
    code = parity.run(args)
    result = json.loads(capsys.readouterr().out)
    assert code == (0 if result["passed"] else 1)
    return result


@pytest.mark.slow
def test_check_parity_tp2_dense(tiny_hf_dirs, capsys):
    r = check(tiny_hf_dirs["tiny-llama"], 2, 1, capsys)
    assert r["placement"] == "subprocess" and r["tensor"] == 2
    assert r["before_mean_abs_delta"] > 0.05  # the check can fail
    assert r["mean_abs_delta"] < 1e-5 and r["max_abs_delta"] < 1e-4 and r["passed"]
    assert r["tokens"] > 100 and r["bytes_pushed"] > 4e6
    assert r["push_seconds"] > 0 and r["copy_seconds"] > 0 and r["push_to_copy_ratio"] > 0


@pytest.mark.slow
def test_check_parity_tp2_ep2_llama4(tiny_hf_dirs, capsys):
    r = check(tiny_hf_dirs["tiny-llama4"], 2, 2, capsys)
    assert r["tensor"] == r["expert"] == 2 and r["before_mean_abs_delta"] > 0.05
    assert r["mean_abs_delta"] < 1e-5 and r["max_abs_delta"] < 1e-4 and r["passed"]


POOL_THEN_WAIT = """
import sys, time
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.pool import GeneratorPool
if __name__ == "__main__":
    pool = GeneratorPool(sys.argv[1], RolloutConfig(placement="subprocess", max_tokens=8))
    print("ENGINE_PID", pool._engines[0].worker.pid, flush=True)
    time.sleep(600)
"""


def test_engine_process_exits_when_its_trainer_is_killed(tiny_hf_dirs, tmp_path):
    """A SIGKILLed trainer cannot stop its engine processes; they notice and exit (else they
    would keep their memory and GPUs)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    script = tmp_path / "pool.py"
    script.write_text(POOL_THEN_WAIT)
    trainer = subprocess.Popen(
        [sys.executable, str(script), tiny_hf_dirs["tiny-llama"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        line = ""
        while not line.startswith("ENGINE_PID"):  # vLLM logs to stdout too
            line = trainer.stdout.readline()
            assert line, "the pool script ended early"
        engine_pid = int(line.split()[1])
        assert running(engine_pid)
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and running(engine_pid):
            time.sleep(0.2)
        if running(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
            pytest.fail("the engine process outlived its killed trainer by 20 s")
    finally:
        trainer.kill()


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever PID 1 is, or not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False

"""Multi-rank trainers (gloo ranks spawned here) pushing into an engine process:
``megatron-rl check-parity --tp 2`` on the tiny dense Llama (embedding tied to the head) and
``--tp 2 --ep 2`` on the tiny Llama-4 (attention split over 2 TP ranks, experts over 2 EP
ranks).
After the push vLLM's log-probs equal Megatron's (fp32); before it they differ."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_rl.platform import LAUNCHER_VARS
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
def test_check_parity_tp2_ep2_llama4(tiny_hf_dirs, capsys):
    r = check(tiny_hf_dirs["tiny-llama4"], 2, 2, capsys)
    assert r["tensor"] == r["expert"] == 2 and r["before_mean_abs_delta"] > 0.05
    assert r["mean_abs_delta"] < 1e-5 and r["max_abs_delta"] < 1e-4 and r["passed"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_check_parity_tp2_tied_embeddings_json_only_on_stdout(tiny_hf_dirs):
    """The command as a user runs it, TP=2 into an engine process: stdout is the JSON alone
    (vLLM logs to stderr), and a model whose lm_head is tied to the embedding (Llama-3.2-1B/3B)
    passes after the push (before the fix its engine kept sampling from the first load's
    head: mean gap 0.13)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "check-parity", tiny_hf_dirs["tiny-llama-tied"]]
        + ["--tp", "2", "--json", "--prompts", "4"],
        capture_output=True,
        text=True,
        env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    r = json.loads(proc.stdout)  # nothing but the JSON
    assert "INFO" in proc.stderr  # the logs went to stderr
    assert r["placement"] == "subprocess" and r["tensor"] == 2
    assert r["before_mean_abs_delta"] > 0.05  # the check can fail
    assert r["mean_abs_delta"] < 1e-5 and r["max_abs_delta"] < 1e-4, r
    assert proc.returncode == 0 and r["passed"]
    assert r["tokens"] > 100 and r["bytes_pushed"] > 4e6
    assert r["push_seconds"] > 0 and r["copy_seconds"] > 0 and r["push_to_copy_ratio"] > 0


POOL_THEN_WAIT = """
import sys, time
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.pool import GeneratorPool
if __name__ == "__main__":
    pool = GeneratorPool(sys.argv[1], RolloutConfig(placement="subprocess", max_tokens=8))
    print("HELPER_PID", pool.engine_handles()[0].pid, flush=True)
    time.sleep(600)
"""


def test_engine_process_exits_when_its_trainer_is_killed(tiny_hf_dirs, tmp_path):
    """A SIGKILLed trainer cannot stop its engine processes; they notice and exit (else they
    would keep their memory and GPUs)."""
    from support.orphans import assert_helper_exits_with_parent

    assert_helper_exits_with_parent(
        POOL_THEN_WAIT,
        [tiny_hf_dirs["tiny-llama"]],
        tmp_path,
        "the engine process",
        within=20,
        VLLM_CPU_KVCACHE_SPACE="1",
    )

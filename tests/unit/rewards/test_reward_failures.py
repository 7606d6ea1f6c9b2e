"""Issue 45 section 1 and issue 49 item 6: nothing a policy writes stops a run.

A failure to score one response (an exception in this process or in a math worker, in the
math or the code path; a worker killed while it verifies) is that response's alone: it scores
``incorrect_reward`` with the status "error" (or "crashed"), is logged once per kind with the
response, and its neighbours in the batch score as they would alone. A worker that dies
mid-answer is replaced and the answer verified again. Only a broken reward (more than
``reward.max_error_fraction`` of a batch failing; workers that cannot start) stops a run.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards import code as code_reward
from megatron_rl.rewards import math as math_reward
from megatron_rl.rewards.pool import (
    RewardFailure,
    check_error_fraction,
    count_errors,
)
from megatron_rl.rewards.workers import WorkerPool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
# "10^{400}" overflows a float (math.isclose of it raised OverflowError in issue 45).
BIG = "10^{400}"


def respond(answer: str) -> str:
    return f"<think>reasoning</think>The answer is $\\boxed{{{answer}}}$."


# Task functions the math workers run in place of ``math.verify`` (pickled by name: the
# worker imports this module).
def _verify_or_raise(prediction: str, reference: str, timeout_s: float) -> str:
    if prediction == BIG:
        return str(float(10**400))  # OverflowError: int too large to convert to float
    return math_reward.verify(prediction, reference, timeout_s)


def _slow_verify(prediction: str, reference: str, timeout_s: float) -> str:
    time.sleep(3.0)  # no CPU time: only the wall-clock backstop (30 s) could end it
    return math_reward.verify(prediction, reference, timeout_s)


def _crash() -> None:
    os._exit(3)


def _unpicklable():
    return lambda: 0  # a result the worker cannot send back


def _answer_after(seconds: float, answer: str) -> str:
    time.sleep(seconds)  # no CPU time
    return answer


def _failing_init() -> None:
    raise ImportError("no module named 'math_verify' (a broken environment)")


def failures(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "scoring a" in r.getMessage()]


def test_an_exception_in_process_scores_only_its_response_incorrect(monkeypatch, caplog):
    """``math.prepare`` (the trainer-side checks) raising on two responses of a batch: they
    score -1 with the status "error", logged once for the kind with the response; the plain
    integers around them are decided as always (+1 for 4 vs 4, -1 for 5 vs 4)."""
    real = math_reward.prepare

    def prepare(response, answer, config):
        if "boom" in response:
            raise OverflowError("int too large to convert to float")
        return real(response, answer, config)

    monkeypatch.setattr(math_reward, "prepare", prepare)
    responses = [respond("4"), respond("boom"), respond("5"), respond("boom again " + "x" * 5000)]
    with caplog.at_level(logging.WARNING), RewardPool(RewardConfig(num_workers=1)) as pool:
        rewards = pool.score_batch(responses, ["4"] * 4)
        assert rewards == [1.0, -1.0, -1.0, -1.0]
        assert pool.last_statuses == ["in_process", "error", "in_process", "error"]
        assert count_errors(pool.last_statuses) == 2 and pool.last_crashes == [0] * 4
        assert pool.worker_pids() == []  # decided in this process: no worker was started
    logged = failures(caplog)
    assert len(logged) == 1  # once per kind, with the (first) response
    assert "OverflowError" in logged[0] and "boom" in logged[0] and "'4'" in logged[0]


def test_an_exception_in_a_math_worker_scores_only_its_response_incorrect(monkeypatch, caplog):
    """The same in a worker process (a real ``WorkerPool``): the answer whose verification
    raises scores -1 ("error"); the others get Math-Verify's verdicts (1/2 = 0.5; 1/3 is
    not 0.5)."""
    monkeypatch.setattr(math_reward, "verify", _verify_or_raise)
    responses = [respond("\\frac{1}{2}"), respond(BIG), respond("\\frac{1}{3}")]
    with caplog.at_level(logging.WARNING), RewardPool(RewardConfig(num_workers=1)) as pool:
        rewards = pool.score_batch(responses, ["0.5", "0.5", "0.5"])
        assert rewards == [1.0, -1.0, -1.0]
        assert pool.last_statuses == ["correct", "error", "wrong"]
    logged = failures(caplog)
    assert len(logged) == 1 and "in a worker: OverflowError" in logged[0]
    assert BIG in logged[0]


def test_an_exception_in_the_code_path_scores_only_its_response_incorrect(monkeypatch, caplog):
    """A code item whose scoring raises (in a thread of the pool) scores -1 ("error"); the
    math items of the same batch and the other code item are scored as alone."""

    def outcome(response, tests, config):
        if "boom" in response:
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON report")
        return code_reward.CodeOutcome(code_reward.CORRECT)

    monkeypatch.setattr(code_reward, "code_outcome", outcome)
    config = RewardConfig(num_workers=1, code_allow_unsafe_sandbox=True)
    with caplog.at_level(logging.WARNING), RewardPool(config) as pool:
        rewards = pool.score_batch(
            ["```python\nboom\n```", "```python\nprint(1)\n```", respond("4")],
            [{"inputs": [""], "outputs": ["1"]}] * 2 + ["4"],
            ["code", "code", "math"],
        )
        assert rewards == [-1.0, 1.0, 1.0]
        assert pool.last_statuses == ["error", "correct", "in_process"]
    logged = failures(caplog)
    assert len(logged) == 1 and "RecursionError" in logged[0] and "boom" in logged[0]


def test_a_worker_killed_mid_answer_is_replaced_and_the_answer_verified_again(monkeypatch, caplog):
    """Issue 49 item 6: the worker verifying a correct answer is SIGKILLed mid-task. The
    answer is verified again on a new worker and scores +1 (it scored -1, "crashed", with no
    word); the death is counted (``last_crashes``) and logged as a warning."""
    monkeypatch.setattr(math_reward, "verify", _slow_verify)
    with caplog.at_level(logging.WARNING), RewardPool(RewardConfig(num_workers=1)) as pool:
        assert pool.score_batch([respond("x^2")], ["x^{2}"]) == [1.0]  # the worker is up
        (victim,) = pool.worker_pids()
        out: dict = {}
        scoring = threading.Thread(
            target=lambda: out.update(r=pool.score_batch([respond("1/2")], ["0.5"]))
        )
        scoring.start()
        time.sleep(1.0)  # the task was sent at once (the worker was idle); it sleeps 3 s
        assert scoring.is_alive()
        os.kill(victim, signal.SIGKILL)
        scoring.join(timeout=120)
        assert out["r"] == [1.0]
        assert pool.last_statuses == ["correct"] and pool.last_crashes == [1]
        assert pool.worker_pids() not in ([], [victim])
    died = [r for r in caplog.records if "died (killed by SIGKILL)" in r.getMessage()]
    assert len(died) == 1 and died[0].levelno == logging.WARNING
    assert "runs again" in died[0].getMessage()


def test_a_task_whose_worker_dies_twice_is_crashed_and_the_pool_goes_on():
    with WorkerPool(num_workers=1, timeout_s=5.0) as workers:
        (result,) = workers.map(_crash, [()])
        assert (result.status, result.crashes) == ("crashed", 2)
        assert "exit status 3" in result.error and workers.num_crashed == 2
        assert workers.map(abs, [(-3,)])[0].value == 3


def test_a_result_the_worker_cannot_send_is_an_error_of_its_task_alone():
    """A worker whose result does not pickle used to die in its send ("crashed", and now a
    retry): the task is an "error" and the worker serves the next task."""
    with WorkerPool(num_workers=1, timeout_s=5.0) as workers:
        before = workers.worker_pids()
        (result,) = workers.map(_unpicklable, [()])
        assert result.status == "error" and "unsendable result" in result.error
        assert result.crashes == 0 and workers.worker_pids() == before
        assert workers.map(abs, [(-3,)])[0].value == 3


def test_a_map_left_half_done_never_answers_the_next_one():
    """Issue 45: a map that raised half-way (here a task that does not pickle; an interrupt
    alike) left its other task running, and the next map read that task's reply as its own
    item with the same index ("old" for item 0), and timed out its item 1 on the worker
    that never got the task that failed to pickle. The workers of an abandoned map are now
    replaced, and a reply must carry its map's id."""
    with WorkerPool(num_workers=3, timeout_s=5.0, wall_timeout_s=8.0) as workers:
        while not all(w.ready for w in workers._workers):  # all three idle, in order
            workers._wait_and_collect([])
        before = workers.worker_pids()
        with pytest.raises(Exception, match="pickle"):
            workers.map(_answer_after, [(2.0, "old"), (0.0, lambda: 0)])
        results = workers.map(_answer_after, [(0.0, "new 0"), (0.0, "new 1")])
        assert [(r.status, r.value) for r in results] == [("ok", "new 0"), ("ok", "new 1")]
        assert len(set(before) - set(workers.worker_pids())) == 2  # the two busy ones
        assert [r.value for r in workers.map(_answer_after, [(0.0, "next")])] == ["next"]


def test_workers_that_cannot_start_fail_the_batch_with_a_reward_failure(monkeypatch):
    """A broken environment is no response's fault: the batch raises ``RewardFailure`` (the
    trainer stops, after its due checkpoint), it does not score everything -1."""
    monkeypatch.setattr(math_reward, "load_verifier", _failing_init)
    with RewardPool(RewardConfig(num_workers=1)) as pool:
        with pytest.raises(RewardFailure, match="fail to start .*math_verify"):
            pool.score_batch([respond("1/2")], ["0.5"])


def test_the_error_fraction_stops_only_past_the_limit():
    """``reward.max_error_fraction`` 0.5: 3 failures of 6 go on, 4 of 6 stop; "crashed"
    counts as a failure, a timeout or a wrong answer does not."""
    ok = ["correct", "wrong", "timeout"]
    check_error_fraction(ok + ["error", "crashed", "error"], 0.5, "a batch")
    with pytest.raises(RewardFailure) as failed:
        check_error_fraction(["wrong", "timeout"] + ["error", "crashed"] * 2, 0.5, "step 7's batch")
    message = str(failed.value)
    assert "4 of the 6 responses of step 7's batch" in message
    assert "2 crashed, 2 error" in message and "reward.max_error_fraction 0.5" in message
    check_error_fraction(["error"] * 3, 1.0, "a batch")  # 1: never
    with pytest.raises(RewardFailure):
        check_error_fraction(["correct"] * 99 + ["error"], 0.0, "a batch")  # 0: the first
    check_error_fraction([], 0.0, "an empty batch")


@pytest.mark.parametrize("value", [float("nan"), -0.1, 1.5, True, "0.5", float("inf")])
def test_max_error_fraction_is_checked_at_load(value):
    with pytest.raises(ConfigError, match="max_error_fraction"):
        RewardConfig(max_error_fraction=value).validate()


def test_max_error_fraction_error_names_the_recipe_key():
    recipe = os.path.join(ROOT, "recipes", "tiny_cpu.yaml")
    with pytest.raises(ConfigError, match=r"'reward\.max_error_fraction': must be in \[0, 1\]"):
        load_run_config(recipe, ["reward.max_error_fraction=1.5"])
    assert load_run_config(recipe, []).reward.max_error_fraction == 0.5

"""Math reward: equivalence, answer extraction, and hostile model outputs."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards import math as math_reward
from megatron_rl.rewards.extraction import (
    answer_section,
    extract_math_answer,
    last_boxed,
    nesting_depth,
    unsafe_reason,
)
from megatron_rl.rewards.workers import WorkerPool

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(num_workers=2, timeout_s=TIMEOUT_S)) as reward_pool:
        yield reward_pool


def respond(answer: str) -> str:
    return f"<think>some reasoning</think>The final answer is $\\boxed{{{answer}}}$."


# (model answer, reference): equivalent pairs, each a different kind of equivalence.
EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),  # decimal vs fraction
    ("1/2", "\\frac12"),  # slash vs \frac
    ("\\dfrac{3}{4}", "0.75"),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
    ("30^\\circ", "30"),  # degrees
    ("30^{\\circ}", "30"),
    ("5\\text{ cm}", "5"),  # units
    ("10\\%", "0.1"),  # percent
    ("(1,2]", "(1, 2]"),  # interval, spacing
    ("(-\\infty, 3)", "(-\\infty,3)"),
    ("\\{1,2\\}", "\\{2,1\\}"),  # sets: order does not matter
    ("x^2+2x+1", "(x+1)^2"),  # symbolic
    ("x=3", "3"),  # "x = answer"
    ("1,000", "1000"),  # thousands separator
    ("  42 ", "42"),  # spacing
    ("\\boxed{7}", "7"),  # nested \boxed
    ("\\frac{1}{\\frac{1}{2}}", "2"),  # nested braces
]

NOT_EQUIVALENT = [
    ("3", "4"),
    ("\\frac{1}{3}", "0.333"),
    ("[1,2)", "(1,2]"),  # interval ends differ
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("x^2+1", "(x+1)^2"),
    ("-5", "5"),
    ("\\sqrt{3}", "\\sqrt{2}"),
]


def test_equivalent_answers_score_plus_one_and_others_minus_one(pool):
    pairs = EQUIVALENT + NOT_EQUIVALENT
    rewards = pool.score_batch([respond(a) for a, _ in pairs], [ref for _, ref in pairs])
    expected = [1.0] * len(EQUIVALENT) + [-1.0] * len(NOT_EQUIVALENT)
    assert dict(zip(pairs, rewards)) == dict(zip(pairs, expected))


def test_thinking_is_stripped_and_must_be_closed(pool):
    responses = [
        "<think>maybe \\boxed{4}</think> so \\boxed{5}",  # only the part after </think>
        "<think>the answer is \\boxed{5} but I keep thinking",  # never closes: incorrect
        "<think>a</think><think>b \\boxed{9}</think> \\boxed{5}",  # last </think> counts
        "<think>x</think> no box, but the answer is 5",  # fallback pattern
        "<think>x</think> nothing at all",
    ]
    assert pool.score_batch(responses, ["5"] * 5) == [1.0, -1.0, 1.0, 1.0, -1.0]


def test_without_required_thinking_the_whole_response_is_the_answer():
    config = RewardConfig(require_think_end=False)
    assert extract_math_answer("so \\boxed{12}", config) == "12"
    assert extract_math_answer("so \\boxed{12}", RewardConfig()) is None


def test_configured_rewards_and_pattern():
    config = RewardConfig(correct_reward=1.0, incorrect_reward=0.0, answer_pattern=r"ANS=(\d+)")
    with RewardPool(config) as custom:
        rewards = custom.score_batch(["</think> ANS=12", "</think> ANS=13"], ["12", "12"])
        assert custom._math is None  # plain integers are decided without a worker
    assert rewards == [1.0, 0.0]


def test_extraction_helpers():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert last_boxed("\\boxed{\\boxed{a}+b}") == "\\boxed{a}+b"
    assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"
    assert last_boxed("\\boxed{5} and an unclosed \\boxed{6") == "5"
    assert last_boxed("\\fbox{8}") == "8"
    assert last_boxed("no box") is None
    assert answer_section("<think>a</think>b</think>c", "</think>", True) == "c"
    assert nesting_depth("{(a)[b]}") == 2


def test_unsafe_reasons():
    config = RewardConfig()
    assert unsafe_reason("9^{9^{9^9}}", config) is not None  # power in an exponent
    assert unsafe_reason("9^9^9", config) is not None  # power tower
    assert unsafe_reason("2^{1000001}", config) is not None  # exponent over the limit
    assert unsafe_reason("123456!", config) is not None  # factorial over the limit
    assert unsafe_reason("1" * 500, config) is not None  # literal with too many digits
    assert unsafe_reason("{" * 40 + "}" * 40, config) is not None
    assert unsafe_reason("x" * 2000, config) is not None
    for fine in ("2^{10}", "x^{n+1}", "\\frac{1}{2}", "10!", "(1,2]", "e^{i\\pi}"):
        assert unsafe_reason(fine, config) is None, fine


def _payloads(canary: str) -> list[str]:
    return [
        f"__import__('os').system('touch {canary}')",
        f"__import__('pathlib').Path('{canary}').touch()",
        f"(lambda: open('{canary}', 'w').write('x'))()",
        f"exec(\"open('{canary}', 'w')\")",
        f'eval(\'__import__("os").system("touch {canary}")\')',
        f"getattr(__builtins__, '__import__')('os').system('touch {canary}')",
    ]


def test_payloads_would_create_the_canary_if_executed(tmp_path):
    # The payloads are real: evaluated as Python they create the canary.
    for i, payload in enumerate(_payloads(str(tmp_path / "canary"))):
        canary = tmp_path / f"canary{i}"
        code = payload.replace(str(tmp_path / "canary"), str(canary))
        subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=30)
        assert canary.exists(), payload


def test_hostile_outputs_score_minus_one_fast_and_execute_nothing(pool, tmp_path):
    canary = tmp_path / "canary"
    answers = _payloads(str(canary)) + [
        "9^{9^{9^9}}",
        "10^{10^{10}}",
        "{" * 10_000 + "1" + "}" * 10_000,
        "(" * 10_000 + "1" + ")" * 10_000,
        "1" * 1_000_000,
        "\\frac{1}{2}" * 100_000,
        "10^{100000}!",  # passes the static checks, then hits the worker's time limit
    ]
    responses = [respond(a) for a in answers] + [
        "x" * 1_000_000,  # 1 MB of text, no answer
        "<think>" + "\\boxed{" * 100_000 + "</think>\\boxed{" * 50_000,  # unclosed boxes
        "</think>" + "\\left(" * 100_000,
    ]
    started = time.monotonic()
    rewards = pool.score_batch(responses, ["1"] * len(responses))
    elapsed = time.monotonic() - started
    assert rewards == [-1.0] * len(responses)
    assert not canary.exists()
    assert pool.stats["blocked_events"] == 0  # nothing was even attempted
    # Everything is rejected up front except the last answer, which costs at most one
    # time limit plus a worker restart.
    assert elapsed < TIMEOUT_S + 15, elapsed


def test_stuck_verification_is_killed_and_the_worker_replaced():
    # timeout_s < 2 disables Math-Verify's own (signal) limit: only the hard kill is left.
    with RewardPool(RewardConfig(num_workers=1, timeout_s=1.0)) as one:
        assert one.score_batch([respond("\\frac{1}{4}")], ["0.25"]) == [1.0]
        pids = one._math.worker_pids()
        started = time.monotonic()
        rewards = one.score_batch([respond("10^{100000}!"), respond("\\frac{1}{2}")], ["5", "0.5"])
        assert rewards == [-1.0, 1.0]  # the next answer still gets verified
        assert time.monotonic() - started < 20
        assert one.stats["verify_timeout"] == 1
        assert one._math.num_killed == 1
        assert one._math.worker_pids() != pids


def test_score_batch_works_from_another_thread(pool):
    results = []
    thread = threading.Thread(
        target=lambda: results.append(pool.score_batch([respond("0.5")], ["\\frac12"]))
    )
    thread.start()
    thread.join(timeout=60)
    assert results == [[1.0]]


def test_public_one_shot_score():
    assert math_reward.score(respond("\\frac{2}{4}"), "0.5") == 1.0
    assert math_reward.score(respond("9^{9^{9^9}}"), "0.5") == -1.0
    assert math_reward.score("<think>\\boxed{0.5}", "0.5") == -1.0


def test_batch_validation(pool):
    with pytest.raises(ValueError, match="differ in length"):
        pool.score_batch(["a"], [])
    with pytest.raises(ValueError, match="unknown reward kinds"):
        pool.score_batch(["a"], ["1"], kinds=["poetry"])


def _spin() -> None:
    while True:
        pass


def _crash() -> None:
    os._exit(3)


def _double(x: int) -> int:
    return 2 * x


def test_worker_pool_timeout_crash_and_order():
    with WorkerPool(num_workers=2, timeout_s=1.0) as workers:
        results = workers.map(_double, [(i,) for i in range(6)])
        assert [r.value for r in results] == [0, 2, 4, 6, 8, 10]
        started = time.monotonic()
        mixed = workers.map(_spin, [()] * 2)
        assert [r.status for r in mixed] == ["timeout", "timeout"]
        assert time.monotonic() - started < 5
        assert workers.map(_crash, [()])[0].status == "crashed"
        assert [r.value for r in workers.map(_double, [(5,)])] == [10]


def test_config_validation():
    with pytest.raises(ValueError, match="kind"):
        RewardConfig(kind="poetry").validate()
    with pytest.raises(ValueError, match="correct_reward"):
        RewardConfig(correct_reward=-1.0, incorrect_reward=1.0).validate()
    with pytest.raises(ValueError, match="answer_pattern"):
        RewardConfig(answer_pattern="(unclosed").validate()
    with pytest.raises(ValueError, match="timeout_s"):
        RewardConfig(timeout_s=0).validate()
    RewardConfig().validate()

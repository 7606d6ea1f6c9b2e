"""Code reward: test parsing, output comparison, scoring (hostile programs: test_rewards_sandbox)."""

from __future__ import annotations

import json

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards import code as code_reward
from megatron_rl.rewards.code import CodeTest, outputs_match, parse_tests, values_match
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for
from megatron_rl.rewards.sandbox import run_program

# 3 s: the limit includes starting the box and Python, slow on a busy 2-core machine.
CONFIG = RewardConfig(kind="code", code_test_timeout_s=3.0, code_memory_mb=512, num_workers=2)

ADD_TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"}]
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(autouse=True)
def _sandbox():
    try:
        box_for(CONFIG)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")


def respond(program: str) -> str:
    return f"<think>plan</think>Here it is:\n```python\n{program}```\n"


@pytest.mark.timeout(30)
def test_correct_program_passes_all_tests():
    assert code_reward.score_code(respond(ADD_PROGRAM), ADD_TESTS, CONFIG) == 1.0


@pytest.mark.timeout(30)
def test_wrong_or_missing_program_fails():
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    assert code_reward.score_code(respond(wrong), ADD_TESTS, CONFIG) == -1.0
    assert code_reward.score_code("<think>x</think> no code", ADD_TESTS, CONFIG) == -1.0
    # The program sits inside an unclosed thinking section: no answer.
    assert code_reward.score_code(f"<think>```python\n{ADD_PROGRAM}```", ADD_TESTS, CONFIG) == -1.0


@pytest.mark.timeout(30)
def test_functional_tests_call_the_named_function():
    program = "class Solution:\n    def twoSum(self, a, b):\n        return [a, b + 1]\n"
    lcb = [{"input": "1\n2", "output": "[1, 3]", "testtype": "functional"}]
    tests = {"tests": json.dumps(lcb), "fn_name": "twoSum"}
    assert code_reward.score_code(respond(program), tests, CONFIG) == 1.0
    taco = {"inputs": [[1, 2]], "outputs": [[[1, 3]]], "fn_name": "twoSum"}
    assert code_reward.score_code(respond(program), taco, CONFIG) == 1.0
    plain = "def f(x):\n    return x * 2\n"
    assert (
        code_reward.score_code(
            respond(plain), {"tests": {"inputs": [[4]], "outputs": [8]}, "fn_name": "f"}, CONFIG
        )
        == 1.0
    )


def test_parse_tests_formats():
    canonical = [CodeTest("1\n", "2\n")]
    assert parse_tests([{"input": "1\n", "output": "2\n"}]) == canonical
    assert parse_tests(json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})) == canonical
    lcb = [
        {"input": "[1]\n2", "output": "3", "testtype": "functional", "metadata": {"func_name": "g"}}
    ]
    assert parse_tests(lcb) == [CodeTest("[[1], 2]", "3", "g")]
    with pytest.raises(ValueError):
        parse_tests("not json")
    with pytest.raises(ValueError):
        parse_tests([{"input": "1"}])
    with pytest.raises(ValueError):
        parse_tests([{"input": "1", "output": "2", "testtype": "functional"}])


def test_output_comparison():
    assert outputs_match("1 2\n3  \n\n", "1 2\n3")
    assert outputs_match("0.3333333\n", "0.33333333")
    assert not outputs_match("1 2", "1 3")
    assert values_match([1, 2.0000001], [1, 2])
    assert values_match(5, [5])
    assert not values_match(True, 1)


@pytest.mark.timeout(30)
def test_programs_may_use_their_own_scratch_space():
    program = (
        "import tempfile\nopen('scratch.txt', 'w').write('x')\n"
        "with tempfile.NamedTemporaryFile('w+') as f:\n    f.write('y')\n    f.seek(0)\n"
        "    print(open('scratch.txt').read() + f.read())\n"
    )
    result = run_program(program, "", CONFIG)
    assert result.status == "ok" and result.stdout.strip() == "xy", result


@pytest.mark.timeout(30)
def test_a_hanging_program_times_out():
    result = run_program("while True:\n    pass\n", "", CONFIG, timeout_s=1.0)
    assert result.status == "timeout"
    assert 1.0 <= result.elapsed_s < 1.0 + 10.0  # start-up on a busy machine


@pytest.mark.timeout(30)
def test_reward_pool_scores_code_in_parallel():
    wrong = "print(0)\n"
    with RewardPool(CONFIG) as pool:
        rewards = pool.score_batch(
            [respond(ADD_PROGRAM), respond(wrong), respond("while True:\n    pass\n")],
            [ADD_TESTS] * 3,
        )
        mixed = pool.score_batch(
            [respond(ADD_PROGRAM), "</think>\\boxed{4}"], [ADD_TESTS, "4"], kinds=["code", "math"]
        )
    assert rewards == [1.0, -1.0, -1.0]
    assert mixed == [1.0, 1.0]

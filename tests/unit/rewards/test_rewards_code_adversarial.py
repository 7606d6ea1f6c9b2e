"""The code reward against programs a policy would try on it (issue 45).

``tests/data/code_adversarial_suite.jsonl`` (``tools/build_code_adversarial_suite.py``):
crashes (big integers, malformed or forged reports, results nested past the recursion
limit), false positives (integer tolerance, non-finite values, Python-only number spellings,
one-element lists, MBPP's ``is``, attacks on the harness) and misses (a worker thread with a
larger stack, an example-usage block, MBPP's bare assert), each class with several probes and
matched controls. A second reading added: a program's stderr taken for the box's failure (an
"error" status, which counts against ``reward.max_error_fraction``), zero-padded digits
("11" for "0011"), a set for an expected list, stdin readers the graded-block rule did not
see, MBPP's ``math.isclose`` with an integer reference, an isclose line's tolerance given to a
problem's ``==`` lines, LeetCode-style names (``List``, ``defaultdict``) used without their
import, a script's thread started without a join, and output written from an ``atexit``
function. Scored through ``RewardPool.score_batch`` with a recipe's reward settings, the call
training makes: every item must get the reward a correct grader gives, and nothing may raise.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from megatron_rl.config import load_run_config
from megatron_rl.rewards import RewardPool
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for

ROOT = Path(__file__).resolve().parents[3]
SUITE = ROOT / "tests" / "data" / "code_adversarial_suite.jsonl"
RECIPE = ROOT / "recipes" / "tiny_cpu_math_code.yaml"
CLASSES = {
    "crash_big_int",
    "crash_report",
    "crash_nesting",
    "int_tolerance",
    "non_finite",
    "python_number",
    "only_element",
    "mbpp_is",
    "harness_attack",
    "miss_thread",
    "miss_usage_block",
    "miss_mbpp_truthy",
    "error_forgery",
    "zero_padded",
    "set_as_list",
    "miss_stdin_reader",
    "miss_mbpp_isclose",
    "mbpp_tolerance",
    "miss_leetcode_names",
    "miss_thread_unjoined",
    "miss_atexit",
}


def _cases() -> list[dict]:
    with open(SUITE) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


def test_suite_covers_every_class_with_probes_and_controls():
    cases = _cases()
    assert {case["class"] for case in cases} == CLASSES
    probes = Counter(case["class"] for case in cases if case["role"] == "probe")
    controls = Counter(case["class"] for case in cases if case["role"] == "control")
    assert all(probes[c] >= 3 for c in CLASSES), probes
    assert all(controls[c] >= 1 for c in CLASSES), controls
    assert len({case["id"] for case in cases}) == len(cases)
    # Probes of crash and false-positive classes are wrong answers; misses are right ones.
    for case in cases:
        if case["role"] == "probe":
            assert case["expect"] == (1 if case["class"].startswith("miss") else -1), case["id"]


@pytest.mark.timeout(600)
def test_every_item_gets_the_reward_a_correct_grader_gives():
    reward = load_run_config(RECIPE).reward
    reward.kind = "code"
    try:
        box_for(reward)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")
    cases = _cases()
    with RewardPool(reward) as pool:
        rewards = pool.score_batch([c["response"] for c in cases], [c["tests"] for c in cases])
        statuses = pool.last_statuses
    wrong = [
        (c["id"], c["note"], status, got)
        for c, got, status in zip(cases, rewards, statuses)
        if got != c["expect"]
    ]
    assert wrong == []
    # Decided by the programs' runs, not by a failing sandbox or an unreadable test.
    assert set(statuses) <= {"correct", "wrong"}, Counter(statuses)

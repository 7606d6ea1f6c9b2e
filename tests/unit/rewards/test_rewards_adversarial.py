"""The math reward against outputs a policy would try on a verifier (issues 37 and 45).

``tests/data/math_adversarial_suite.jsonl``: answers with an extra variable term or a unit,
times of day, hedges and several boxes, a box in the thinking, restated questions, LaTeX
macros that expand to the reference, very long answers, numbers with units against symbolic
references, and guards for the forms the reward reads itself (issue 37); tolerances, percent
and multiplier words, units that disagree, words that are no units, unevaluated operators,
false equations, hidden LaTeX, multiple-choice hedges, retractions, and the right answers the
reward missed (issue 45). Every case without ``"expected": true`` must score incorrect: a
single false-positive class is enough for a policy to learn it. The cases with it are the
matched controls (the same answer written correctly, in the forms real models use) and must
score correct: a tightening must not take them.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool

SUITE = Path(__file__).resolve().parents[2] / "data" / "math_adversarial_suite.jsonl"


def _cases() -> list[dict]:
    with open(SUITE) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(RewardConfig(num_workers=2)) as reward_pool:
        yield reward_pool


# Issue 45's classes: each has several probes and matched controls.
ISSUE_45 = {
    "tolerance",
    "percent",
    "multiplier",
    "unit_mismatch",
    "not_unit",
    "unevaluated",
    "false_equation",
    "hidden_latex",
    "choice_hedge",
    "retraction",
    "miss_interval",
    "miss_degrees",
    "miss_units",
    "miss_complex",
    "miss_hyperbolic",
    "miss_ordering",
    "infinity",
}


def test_suite_covers_every_class():
    classes = Counter(case["class"] for case in _cases())
    expected = {"extra_term", "time_of_day", "hedge", "think_box", "restate", "macro", "long"}
    assert expected | {"unit_vs_symbol", "guard"} | ISSUE_45 <= set(classes)
    assert all(count >= 3 for count in classes.values()), classes
    assert len({case["id"] for case in _cases()}) == sum(classes.values())
    for name in ISSUE_45:
        verdicts = Counter(bool(c.get("expected")) for c in _cases() if c["class"] == name)
        assert verdicts[True] >= 2 and verdicts[False] >= 2, (name, verdicts)


def test_every_adversarial_output_scores_incorrect_and_every_control_correct(pool):
    cases = _cases()
    rewards = pool.score_batch([c["response"] for c in cases], [c["reference"] for c in cases])
    assert pool.last_counts["timeout"] == 0
    assert pool.last_counts["crashed"] == pool.last_counts["error"] == 0
    rewarded = [
        (c["id"], c["reference"], c["note"])
        for c, r in zip(cases, rewards)
        if r > 0 and not c.get("expected")
    ]
    assert rewarded == []
    missed = [
        (c["id"], c["reference"], c["note"])
        for c, r in zip(cases, rewards)
        if r <= 0 and c.get("expected")
    ]
    assert missed == []


OPEN = SUITE.with_name("math_adversarial_open.jsonl")


def _open_cases() -> list[dict]:
    with open(OPEN) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def open_scores(pool):
    """The open findings scored in one batch (the call training makes), by id."""
    cases = _open_cases()
    rewards = pool.score_batch([c["response"] for c in cases], [c["reference"] for c in cases])
    return dict(zip((c["id"] for c in cases), rewards))


@pytest.mark.xfail(strict=True, reason="an open finding of issue 45's second reading")
@pytest.mark.parametrize("case", _open_cases(), ids=lambda c: c["id"])
def test_open_finding(case, open_scores):
    """Each open false positive or miss of the second reading (tests/data/
    math_adversarial_open.jsonl) scores as a correct grader would: expected to fail until it
    is fixed; a fixed one passes, fails the suite (strict), and moves to the suite."""
    assert (open_scores[case["id"]] > 0) == bool(case.get("expected")), case["note"]

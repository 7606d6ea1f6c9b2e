"""The math reward against outputs a policy would try on a verifier (issue 37).

``tests/data/math_adversarial_suite.jsonl``: answers with an extra variable term or a unit,
times of day, hedges and several boxes, a box in the thinking, restated questions, LaTeX
macros that expand to the reference, very long answers, numbers with units against symbolic
references, and guards for the forms the reward reads itself. Every one must score incorrect:
a single false-positive class is enough for a policy to learn it.
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


def test_suite_covers_every_class():
    classes = Counter(case["class"] for case in _cases())
    expected = {"extra_term", "time_of_day", "hedge", "think_box", "restate", "macro", "long"}
    assert expected | {"unit_vs_symbol", "guard"} <= set(classes)
    assert all(count >= 3 for count in classes.values()), classes
    assert len({case["id"] for case in _cases()}) == sum(classes.values())


def test_every_adversarial_output_scores_incorrect(pool):
    cases = _cases()
    rewards = pool.score_batch([c["response"] for c in cases], [c["reference"] for c in cases])
    assert pool.last_counts["timeout"] == 0
    rewarded = [(c["id"], c["reference"], c["note"]) for c, r in zip(cases, rewards) if r > 0]
    assert rewarded == []

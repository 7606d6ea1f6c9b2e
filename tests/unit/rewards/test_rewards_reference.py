"""Issue 41 item 5: the reward API refuses an item without a reference, naming it."""

from __future__ import annotations

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards.pool import MissingReferenceError, check_references


@pytest.mark.parametrize("missing", [None, float("nan"), "", "  \n", []])
def test_a_missing_reference_is_refused_naming_the_item(missing):
    # Read as the text "None", a None reference paid +1 to a response boxing "None".
    responses = ["</think>\\boxed{3}", "</think>\\boxed{None}", "</think>\\boxed{nan}"]
    with RewardPool(RewardConfig(kind="math", num_workers=1)) as pool:
        with pytest.raises(MissingReferenceError, match="item 1 of the batch"):
            pool.score_batch(responses, ["3", missing, "4"])
        with pytest.raises(MissingReferenceError, match="item 0 of the batch"):
            pool.score_batch(responses[:1], [missing], kinds=["code"])
        # The batch with its references is scored as before.
        assert pool.score_batch(responses[:1], ["3"]) == [1.0]


def test_callers_name_the_row_their_own_way():
    check_references(["1", {"tests": []}, 0, 0.0])  # present, if odd: not "missing"
    with pytest.raises(MissingReferenceError, match=r"data.jsonl line 7: the reference is missing"):
        check_references(["1", None], names=["data.jsonl line 3", "data.jsonl line 7"])

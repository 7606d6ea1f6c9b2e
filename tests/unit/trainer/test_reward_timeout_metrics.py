"""Issue 37 item 9: a code run stopped by the wall-clock backstop is counted in the step's
metrics as a timeout of its own, not only as one more wrong answer."""

from __future__ import annotations

from types import SimpleNamespace

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rollout.samples import Sample
from megatron_rl.trainer.rollout_source import Group
from megatron_rl.trainer.scoring import score_groups

# One status per sample of a group of five: a math verification out of time and a program
# stopped by the wall-clock backstop are no verdicts; a program over its CPU-time limit is one.
STATUSES = ["correct", "wrong", "timeout", "timeout_wall", "timeout_cpu"]


class FixedRewards:
    def __init__(self):
        self.last_statuses: list[str] = []
        self.last_crashes: list[int] = []

    def score_batch(self, texts, references, kinds):
        self.last_statuses = list(STATUSES)
        self.last_crashes = [0] * len(STATUSES)
        return [1.0 if s == "correct" else -1.0 for s in STATUSES]


def test_wall_clock_timeouts_are_counted_apart_in_the_step_metrics():
    samples = [
        Sample(0, i, [1, 2], [3], [-0.1], [0], [True], finish_reason="stop") for i in range(5)
    ]
    group = Group(prompt_id=0, size=5, submitted_version=0, samples=samples)
    run = SimpleNamespace(
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "x"),
        data=SimpleNamespace(
            get=lambda pid: SimpleNamespace(reference="1", kind="code"), sources=["code"]
        ),  # fmt: skip
        rewards=FixedRewards(),
        tracker=None,
        config=SimpleNamespace(rollout=SimpleNamespace(episodes=False), reward=RewardConfig()),
    )
    _, info = score_groups(run, [group], version=0)
    assert (group.reward_timeouts, group.reward_timeouts_wall) == (2, 1)
    assert info["reward_timeouts"] == 2 and info["reward_timeouts_wall"] == 1
    assert info["pass_rate"] == 1 / 5

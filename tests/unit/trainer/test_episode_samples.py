"""Issue 38: a multi-turn episode's tool tokens (mask False, log-prob 0, ``TOOL_VERSION``)
reach the trainer as data the policy did not make: no loss on them, the log-prob gap monitor
and the staleness read the model's tokens only, and the reward reads the model's text only."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_rl.rollout.samples import TOOL_VERSION, Sample
from megatron_rl.trainer.batch import TrainSample, flat_response_tensors
from megatron_rl.trainer.rollout_source import Group
from megatron_rl.trainer.scoring import score_groups

T = TOOL_VERSION
# model turn (version 3) / tool output / model turn (version 3)
IDS = [10, 11, 12, 80, 81, 20, 21]
MASK = [True, True, True, False, False, True, True]
VERSIONS = [3, 3, 3, T, T, 3, 3]


def test_tool_tokens_get_no_loss_and_an_all_one_version_episode_is_monitored_on_model_tokens():
    sample = TrainSample(
        0, 0, [1, 2], IDS, [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2, MASK, 1.0, VERSIONS
    )
    cols = flat_response_tensors([sample], torch.tensor([1.0]), torch.tensor([True]), None, 3)
    assert cols["mask"].tolist() == MASK  # the loss (and its per-prompt token count)
    # generated entirely by version 3 (the tool's tokens have none): monitored, model tokens only
    assert cols["monitor"].tolist() == MASK
    mixed = TrainSample(0, 0, [1, 2], IDS, [0.0] * 7, MASK, 1.0, [2, 2, 2, T, T, 3, 3])
    cols = flat_response_tensors([mixed], torch.tensor([1.0]), torch.tensor([True]), None, 3)
    assert not cols["monitor"].any()  # two policy versions: not on-policy


class Rewards:
    def __init__(self):
        self.last_statuses: list[str] = []
        self.last_crashes: list[int] = []
        self.texts: list[str] = []

    def score_batch(self, texts, references, kinds):
        self.texts = list(texts)
        self.last_statuses = ["correct"] * len(texts)
        self.last_crashes = [0] * len(texts)
        return [1.0] * len(texts)


def test_staleness_skips_tool_tokens_and_the_reward_reads_the_model_text_only():
    sample = Sample(0, 0, [1, 2], IDS, [0.0] * 7, VERSIONS, MASK, finish_reason="stop")
    group = Group(prompt_id=0, size=1, submitted_version=3, samples=[sample])
    rewards = Rewards()
    run = SimpleNamespace(
        tokenizer=SimpleNamespace(
            decode=lambda ids, skip_special_tokens: "".join(f"<{i}>" for i in ids)
        ),
        data=SimpleNamespace(
            get=lambda pid: SimpleNamespace(reference="1", kind="math"), sources=["math"]
        ),
        rewards=rewards,
        tracker=None,
        config=SimpleNamespace(
            rollout=SimpleNamespace(episodes=True), reward=SimpleNamespace(max_error_fraction=0.5)
        ),
    )
    sample.tools = [("ok", 0.5)]
    _, info = score_groups(run, [group], version=5)
    # a multi-turn run's step metrics: its episodes' tool use
    assert info["tool_calls"] == 1 and info["tool_seconds"] == 0.5
    assert info["tool_episode_fraction"] == 1.0
    assert info["staleness_max"] == 2 and info["staleness_mean"] == 2.0  # 5 - 3, not 5 - (-1)
    # each model turn decoded alone, the tool's output (80, 81) left out
    assert rewards.texts == ["<10><11><12><20><21>"]
    assert sample.oldest_version == 3 and sample.newest_version == 3

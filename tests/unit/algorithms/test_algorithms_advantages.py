"""Advantages, zero-variance filter, length penalty, No-Positive-Resampling, config."""

import json
import math
import subprocess
import sys

import pytest
import torch

from megatron_rl.algorithms import (
    AGGREGATIONS,
    LOSSES,
    NORMALIZATIONS,
    AlgorithmConfig,
    PassRateTracker,
    compute_advantages,
    length_penalty,
    zero_variance_mask,
)
from megatron_rl.algorithms.config import AGGREGATION_NAMES, LOSS_NAMES, NORMALIZATION_NAMES

# Three groups: g0 rewards 1,-1,1,-1 (mean 0, std 1); g1 3,0,0 (mean 1, A = 2,-1,-1,
# std sqrt(2)); g2 5,5 (zero variance).
REWARDS = torch.tensor([1.0, -1.0, 1.0, -1.0, 3.0, 0.0, 0.0, 5.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 0, 10, 10, 10, 4, 4])
CENTERED = [1.0, -1.0, 1.0, -1.0, 2.0, -1.0, -1.0, 0.0, 0.0]
EPS = 1e-6


def test_zero_variance_mask_by_hand():
    mask = zero_variance_mask(REWARDS, GROUPS)
    assert mask.tolist() == [True] * 7 + [False, False]
    # a single-sample group and an all-equal group are both zero-variance
    single = zero_variance_mask(torch.tensor([1.0, 2.0, 2.0, 0.5]), torch.tensor([0, 1, 1, 2]))
    assert single.tolist() == [False, False, False, False]


def test_advantages_none_by_hand():
    adv = compute_advantages(REWARDS, GROUPS, normalization="none")
    assert adv.tolist() == pytest.approx(CENTERED, abs=1e-7)


def test_advantages_group_by_hand():
    adv = compute_advantages(REWARDS, GROUPS, normalization="group", eps=EPS)
    s2 = math.sqrt(2.0)
    expected = [1 / (1 + EPS), -1 / (1 + EPS)] * 2
    expected += [2 / (s2 + EPS), -1 / (s2 + EPS), -1 / (s2 + EPS), 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)


def test_advantages_batch_by_hand_with_keep():
    keep = zero_variance_mask(REWARDS, GROUPS)
    adv = compute_advantages(REWARDS, GROUPS, normalization="batch", keep=keep, eps=EPS)
    # kept centred advantages 1,-1,1,-1,2,-1,-1: mean 0, sum of squares 10 over 7 samples
    std = math.sqrt(10 / 7)
    expected = [a / (std + EPS) for a in CENTERED[:7]] + [0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)
    # without keep the two zero advantages enter the std: sqrt(10 / 9)
    adv_all = compute_advantages(REWARDS, GROUPS, normalization="batch", eps=EPS)
    assert adv_all.tolist() == pytest.approx([a / (math.sqrt(10 / 9) + EPS) for a in CENTERED])


def test_dropped_samples_get_zero_advantage():
    keep = torch.tensor([True, False, True, True, True, True, False, True, True])
    for norm in NORMALIZATIONS:
        adv = compute_advantages(REWARDS, GROUPS, normalization=norm, keep=keep)
        assert adv[1] == 0 and adv[6] == 0
    # the group mean still uses all samples of the group ("none": r - group mean)
    adv = compute_advantages(REWARDS, GROUPS, normalization="none", keep=keep)
    assert adv[4].item() == pytest.approx(2.0)


def _random_rewards(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    groups = torch.arange(12).repeat_interleave(8)
    rewards = torch.randint(0, 2, (96,), generator=gen).float() * 2 - 1
    rewards[:8] = 1.0  # one all-correct group
    rewards[8:16] = -1.0  # one all-wrong group
    perm = torch.randperm(96, generator=gen)  # samples of a group need not be adjacent
    return rewards[perm], groups[perm]


def test_batch_normalisation_gives_unit_std_on_kept_samples():
    rewards, groups = _random_rewards(0)
    keep = zero_variance_mask(rewards, groups)
    assert 0 < keep.sum() < 96
    adv = compute_advantages(rewards, groups, "batch", keep=keep, eps=1e-12)
    kept = adv[keep].double()
    assert kept.std(correction=0).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.all(adv[~keep] == 0)


def test_group_normalisation_gives_unit_std_per_kept_group():
    rewards, groups = _random_rewards(1)
    keep = zero_variance_mask(rewards, groups)
    adv = compute_advantages(rewards, groups, "group", keep=keep, eps=1e-12)
    for g in groups.unique():
        in_group = groups == g
        if keep[in_group].any():
            assert adv[in_group].double().std(correction=0).item() == pytest.approx(1.0, abs=1e-6)
            assert adv[in_group].sum().item() == pytest.approx(0.0, abs=1e-6)
        else:
            assert torch.all(adv[in_group] == 0)  # zero-variance group


def test_advantages_bad_input():
    with pytest.raises(ValueError, match="normalization"):
        compute_advantages(REWARDS, GROUPS, normalization="std")
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(REWARDS, GROUPS[:3])
    with pytest.raises(ValueError, match="keep"):
        compute_advantages(REWARDS, GROUPS, keep=torch.ones(9))


def test_length_penalty_by_hand():
    # l_max 10, l_cache 4: (10 - len) / 4 - 1 clipped to [-1, 0]
    lengths = torch.tensor([5, 6, 7, 10, 12, 7])
    correct = torch.tensor([True, True, True, True, True, False])
    pen = length_penalty(lengths, correct, l_max=10, l_cache=4)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.25, -1.0, -1.0, 0.0])
    with pytest.raises(ValueError, match="l_cache"):
        length_penalty(lengths, correct, l_max=10, l_cache=0)
    with pytest.raises(ValueError, match="correct"):
        length_penalty(lengths, correct.float(), l_max=10, l_cache=4)


def test_pass_rate_tracker_cumulative():
    tracker = PassRateTracker(threshold=0.9)
    retired = tracker.update(torch.tensor([7, 7, 7, 7, 3, 3]), torch.tensor([1, 1, 1, -1, 1, 1.0]))
    # prompt 7: 3/4 = 0.75; prompt 3: 2/2 = 1.0 >= 0.9
    assert retired == [3]
    assert not tracker.is_retired(7) and tracker.is_retired(3)
    assert tracker.pass_rate(7) == pytest.approx(0.75)
    # prompt 7 next epoch: 6/6 -> cumulative 9/10 = 0.9 (>= threshold)
    tracker.update([7] * 6, [1.0] * 6)
    assert tracker.is_retired(7) and tracker.num_retired == 2
    # retired for good, even if later samples fail
    tracker.update([3] * 4, [-1.0] * 4)
    assert tracker.is_retired(3) and tracker.pass_rate(3) == pytest.approx(2 / 6)
    assert tracker.pass_rate(99) is None and not tracker.is_retired(99)


def test_pass_rate_tracker_latest_and_bool_rewards():
    tracker = PassRateTracker(threshold=0.9, history="latest")
    tracker.update([1, 1, 1, 1], [False, False, False, False])
    tracker.update([1] * 10, [True] * 9 + [False])  # latest 0.9, cumulative 9/14
    assert tracker.is_retired(1)
    cumulative = PassRateTracker(threshold=0.9)
    cumulative.update([1, 1, 1, 1], [False] * 4)
    cumulative.update([1] * 10, [True] * 9 + [False])
    assert not cumulative.is_retired(1)
    # with a length penalty a correct reward can be 0: pass correctness as bools instead
    assert PassRateTracker().update([5], [True]) == [5]


def test_pass_rate_tracker_state_dict_round_trip():
    tracker = PassRateTracker(threshold=0.5)
    tracker.update([0, 0, 1, 1, 2], [1.0, 1.0, 1.0, -1.0, -1.0])
    state = json.loads(json.dumps(tracker.state_dict()))
    restored = PassRateTracker()
    restored.load_state_dict(state)
    assert restored.threshold == 0.5 and restored.num_retired == 2
    assert restored.is_retired(0) and restored.is_retired(1) and not restored.is_retired(2)
    restored.update([2, 2], [1.0, 1.0])  # 2/3 >= 0.5
    assert restored.is_retired(2)
    with pytest.raises(ValueError, match="threshold"):
        PassRateTracker(threshold=1.5)
    with pytest.raises(ValueError, match="missing"):
        restored.load_state_dict({"passes": []})


def test_config_defaults_are_scalerl():
    cfg = AlgorithmConfig()
    cfg.validate()
    assert (cfg.loss, cfg.eps_max, cfg.aggregation) == ("cispo", 4.0, "prompt")
    assert cfg.advantage_normalization == "batch" and cfg.zero_variance_filter
    assert cfg.npr_threshold == 0.9 and not cfg.length_penalty
    assert cfg.loss_params() == {"eps_max": 4.0}
    assert AlgorithmConfig(loss="ppo_clip").loss_params() == {"eps_low": 0.2, "eps_high": 0.2}
    assert AlgorithmConfig(loss="gspo").loss_params() == {"eps_low": 3e-3, "eps_high": 4e-3}
    dapo = AlgorithmConfig(loss="ppo_clip", eps_high=0.28)
    assert dapo.loss_params() == {"eps_low": 0.2, "eps_high": 0.28}
    assert AlgorithmConfig(loss="reinforce").loss_params() == {}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss", "dapo"),
        ("eps_max", 0.0),
        ("eps_low", 1.0),
        ("eps_high", -0.1),
        ("aggregation", "batch"),
        ("advantage_normalization", "std"),
        ("npr_threshold", 0.0),
        ("npr_history", "best"),
        ("zero_variance_filter", "yes"),
        ("length_penalty_l_cache", 0),
        ("length_penalty_l_max", 100),
        ("length_penalty_on", "wrong"),
    ],
)
def test_config_validate_names_the_field(field, value):
    cfg = AlgorithmConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.validate()


def test_config_names_match_registries():
    assert tuple(LOSSES) == LOSS_NAMES
    assert tuple(AGGREGATIONS) == AGGREGATION_NAMES
    assert tuple(NORMALIZATIONS) == NORMALIZATION_NAMES
    for name in LOSS_NAMES:  # every loss is constructible from the config's parameters
        LOSSES[name](**AlgorithmConfig(loss=name).loss_params())


def test_config_module_imports_no_torch():
    code = (
        "import sys; import megatron_rl.algorithms.config as c; c.AlgorithmConfig().validate();"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

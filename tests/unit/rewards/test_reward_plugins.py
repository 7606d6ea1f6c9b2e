"""A reward plug-in (entry point group ``megatron_rl.rewards``) loaded through an installed
package's metadata, as a user's package would be, and scored in the reward workers."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.pool import RewardPool

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"

SCORER = '''
def score(answer, reference):
    """Correct when the answer, upper-cased and stripped, equals the reference."""
    if answer.strip() == "raise":
        raise RuntimeError("the scorer failed on purpose")
    if answer.strip() == "half":
        return 0.0
    if answer.strip() == "way out":
        return 7.5
    if answer.strip().startswith("np "):
        import numpy as np

        x = np.float64(float(answer.split()[1]))
        if answer.split()[-1] == "array":
            return np.array([x == 1.0])
        return np.float32(x) if answer.split()[-1] == "f32" else abs(x - 1.0) < 1e-9
    return answer.strip().upper() == reference
'''


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A package ``upper_reward`` with its dist-info, on sys.path and PYTHONPATH (the reward
    workers are fresh interpreters: they find it as an installed package is found)."""
    site = tmp_path / "site"
    (site / "upper_reward").mkdir(parents=True)
    (site / "upper_reward" / "__init__.py").write_text(textwrap.dedent(SCORER))
    info = site / "upper_reward-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: upper-reward\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[megatron_rl.rewards]\nupper = upper_reward:score\n")
    monkeypatch.syspath_prepend(str(site))
    # the repository first, as the tests import it; then the package's site directory
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}:{site}")
    return site


def test_a_plugin_reward_scores_through_the_entry_point_in_the_workers(installed_plugin):
    config = RewardConfig(kind="upper", require_think_end=True, num_workers=1)
    with RewardPool(config) as pool:
        responses = [
            "thinking</think> blue",  # correct: upper-cased it is the reference
            "thinking</think> red",  # wrong
            "no end of thinking blue",  # no answer section: not called, incorrect
            "t</think>half",  # a float between the rewards is the reward
            "t</think>raise",  # the scorer raised: this item alone, status error
            "t</think>way out",  # a float outside [-1, 1]: an error, not a reward of 7.5
        ]
        rewards = pool.score_batch(responses, ["BLUE"] * 6, ["upper"] * 6)
        assert rewards == [1.0, -1.0, -1.0, 0.0, -1.0, -1.0]
        assert pool.last_statuses == ["correct", "wrong", "in_process", "wrong", "error", "error"]
        # math and the plug-in in one batch (a mixture)
        rewards = pool.score_batch(
            ["t</think>\\boxed{4}", "t</think>blue"], ["4", "BLUE"], ["math", "upper"]
        )
        assert rewards == [1.0, 1.0]


def test_a_plugin_returning_numpy_scalars_is_scored_as_their_values(installed_plugin):
    # ``abs(x - y) < tol`` on numpy floats is an np.bool_ (no bool): it was an error, on every
    # item of such a plug-in, which stops the run past reward.max_error_fraction.
    config = RewardConfig(kind="upper", require_think_end=True, num_workers=1)
    with RewardPool(config) as pool:
        responses = [
            "t</think>np 1.0",  # np.True_: correct
            "t</think>np 2.0",  # np.False_: wrong
            "t</think>np 0.0 f32",  # np.float32(0.0) between the rewards: the reward
            "t</think>np 1.0 array",  # an array is no reward: an error
        ]
        rewards = pool.score_batch(responses, ["BLUE"] * 4, ["upper"] * 4)
        assert rewards == [1.0, -1.0, 0.0, -1.0]
        assert pool.last_statuses == ["correct", "wrong", "wrong", "error"]


def test_a_recipe_names_the_plugin_as_a_domain_or_the_reward_kind(installed_plugin):
    sources = "data.sources=[{source: synthetic, name: arith}, {source: synthetic, name: up, domain: upper}]"
    config = load_run_config(TINY, [sources], check_model=False)
    assert [s.domain for s in config.data.resolve()] == ["math", "upper"]
    assert load_run_config(TINY, ["data.domain=upper"], check_model=False).data.domain == "upper"


def test_an_unknown_domain_names_what_is_installed():
    with pytest.raises(ConfigError) as err:
        load_run_config(TINY, ["data.domain=upper"], check_model=False)
    assert err.value.key == "data.domain" and "['math', 'code']" in str(err.value)

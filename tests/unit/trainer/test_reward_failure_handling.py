"""Issue 45 section 1, issue 49 item 6: the trainer's side of scoring failures. A step's
responses whose scoring failed are counted in its metrics (``reward_errors``, worker deaths
in ``reward_crashes``) and the run goes on, unless more than ``reward.max_error_fraction`` of
a batch failed; a validation pass whose reward fails stops every rank, after the step's due
checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.pool import RewardFailure
from megatron_rl.rollout.samples import Sample
from megatron_rl.trainer.rollout_source import Group
from megatron_rl.trainer.scoring import score_groups


class ScriptedRewards:
    """Statuses and worker deaths of each sample, as ``RewardPool`` reports them."""

    def __init__(self, statuses: list[str], crashes: list[int]):
        self.statuses, self.crashes = statuses, crashes
        self.last_statuses: list[str] = []
        self.last_crashes: list[int] = []

    def score_batch(self, texts, references, kinds):
        self.last_statuses, self.last_crashes = list(self.statuses), list(self.crashes)
        return [1.0 if s == "correct" else -1.0 for s in self.statuses]


def scored(statuses: list[str], crashes: list[int], max_error_fraction: float = 0.5):
    """Two groups of four samples scored with ``statuses``; (groups, step info)."""
    groups = [
        Group(
            prompt_id=g,
            size=4,
            submitted_version=0,
            samples=[
                Sample(g, i, [1, 2], [3], [-0.1], [0], [True], finish_reason="stop")
                for i in range(4)
            ],
        )
        for g in range(2)
    ]
    run = SimpleNamespace(
        tokenizer=SimpleNamespace(decode=lambda ids, skip_special_tokens: "x"),
        data=SimpleNamespace(
            get=lambda pid: SimpleNamespace(reference="1", kind="math"), sources=["math"]
        ),
        rewards=ScriptedRewards(statuses, crashes),
        tracker=None,
        config=SimpleNamespace(
            rollout=SimpleNamespace(episodes=False),
            reward=RewardConfig(max_error_fraction=max_error_fraction),
        ),
    )
    _, info = score_groups(run, groups, version=0)
    return groups, info


def test_a_steps_scoring_failures_are_counted_and_the_run_goes_on():
    # 4 of 8 failed ("error", "crashed"): not over 0.5; a retried answer after one worker
    # death is correct, and its death counted.
    statuses = ["correct", "error", "crashed", "wrong"] + ["error", "correct", "timeout", "error"]
    crashes = [1, 0, 2, 0] + [0, 0, 0, 0]
    groups, info = scored(statuses, crashes)
    assert [g.reward_errors for g in groups] == [2, 2]
    assert [g.reward_crashes for g in groups] == [3, 0]
    assert info["reward_errors"] == 4 and info["reward_crashes"] == 3
    assert info["reward_timeouts"] == 1 and info["pass_rate"] == 2 / 8


def test_a_step_with_more_failures_than_the_fraction_stops_the_run():
    statuses = ["error"] * 5 + ["correct"] * 3  # 5 of 8 > 0.5
    with pytest.raises(RewardFailure, match=r"5 of the 8 responses .*reward.max_error_fraction"):
        scored(statuses, [0] * 8)
    scored(statuses, [0] * 8, max_error_fraction=0.7)  # 5/8 = 0.625 <= 0.7: goes on


@pytest.mark.timeout(120)
def test_a_failed_reward_stops_every_rank_after_the_due_checkpoint(tmp_path):
    """Two gloo ranks, rank 0's reward fails (every response). In step 2's validation both
    ranks save the due checkpoint (a collective) and then raise the RewardFailure naming
    the setting; in a training batch both raise it. The other rank used to wait for rank 0
    until validation.timeout_minutes / rollout.batch_timeout_minutes, and nothing was
    saved."""
    from support.mp_workers import reward_failure_worker

    from megatron_rl.platform import run_local_ranks

    started = time.monotonic()
    rank0, rank1 = run_local_ranks(reward_failure_worker, 2, str(tmp_path), 60.0)
    assert rank0 == rank1, (rank0, rank1)
    saved, in_validation, in_batch = rank0
    assert saved == "saved"
    assert in_validation.startswith("RewardFailure: scoring failed on 2 of the 2 responses of "
                                    "the validation pass of step 2 (2 error)"), in_validation  # fmt: skip
    assert in_batch.startswith("RewardFailure: scoring failed on 2 of the 2 responses of a "
                               "training batch (2 error)"), in_batch  # fmt: skip
    for error in (in_validation, in_batch):
        assert "reward.max_error_fraction 0.5" in error
    assert time.monotonic() - started < 60  # not a wait for a timeout


def test_a_stopped_run_resumes_with_a_higher_max_error_fraction(tmp_path):
    """The stop's message says to raise reward.max_error_fraction: a resume may, without
    --allow-changes (it changes no verdict and no update)."""
    from megatron_rl.config import load_run_config, to_yaml
    from megatron_rl.trainer.rundir import RunDirError, check_changes

    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny_cpu.yaml"
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(load_run_config(recipe, [], check_model=False)))
    raised = to_yaml(load_run_config(recipe, ["reward.max_error_fraction=0.9"], check_model=False))
    changes = check_changes(path, raised, allow_changes=False)
    assert changes == {"reward.max_error_fraction": (0.5, 0.9)}
    other = to_yaml(load_run_config(recipe, ["reward.timeout_s=9"], check_model=False))
    with pytest.raises(RunDirError, match="reward.timeout_s"):  # a verdict may change
        check_changes(path, other, allow_changes=False)

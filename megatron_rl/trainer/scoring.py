"""A step's groups scored: rewards (the verifiers), pass-rate history, the batch's stats.

The main rank's half of a step after generation (``loop.next_batch``): every sample of the
rollout source's groups is rewarded (once: dynamic sampling may have scored a group already),
the No-Positive-Resampling history records every scored group (trained on or dropped), and
the samples become :class:`~megatron_rl.trainer.batch.TrainSample` with the step's batch
metrics (rewards, pass and truncation rates, staleness; per domain for a mixture).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_rl.rewards.pool import check_error_fraction, count_errors, count_timeouts
from megatron_rl.rollout.samples import TOOL_VERSION, Sample
from megatron_rl.trainer.batch import TrainSample
from megatron_rl.trainer.rollout_source import DynamicSampling, Group

if TYPE_CHECKING:
    from megatron_rl.trainer.setup import Run


def dynamic_sampling(run: Run) -> DynamicSampling | None:
    """The rollout source's dynamic sampling (``data.dynamic_sampling``), else None."""
    data = run.config.data
    if not data.dynamic_sampling:
        return None
    return DynamicSampling(
        score=lambda groups: reward_groups(run, groups),
        discard=lambda groups: record_pass_rates(run, groups),
        max_rounds=data.dynamic_sampling_max_rounds,
    )


def reward_groups(run: Run, groups: list[Group]) -> None:
    """Score the samples of every group not scored yet (sets ``rewards`` and the counts
    ``reward_timeouts``, ``reward_errors``, ``reward_crashes``). Raises ``RewardFailure``
    when scoring failed on more than ``reward.max_error_fraction`` of them."""
    todo = [g for g in groups if g.rewards is None]
    flat = [(g, s) for g in todo for s in g.samples]
    if not flat:
        return
    texts = [model_text(run.tokenizer, s) for _, s in flat]
    prompts = [run.data.get(g.prompt_id) for g, _ in flat]
    rewards = run.rewards.score_batch(
        texts, [p.reference for p in prompts], [p.kind for p in prompts]
    )
    statuses = list(run.rewards.last_statuses)
    crashes = list(run.rewards.last_crashes)
    start = 0
    for g in todo:
        end = start + len(g.samples)
        g.rewards = [float(r) for r in rewards[start:end]]
        counts = count_timeouts(statuses[start:end])
        g.reward_timeouts, g.reward_timeouts_wall = counts["timeouts"], counts["timeouts_wall"]
        g.reward_errors = count_errors(statuses[start:end])
        g.reward_crashes = sum(crashes[start:end])
        start = end
    check_error_fraction(statuses, run.config.reward.max_error_fraction, "a training batch")


def model_text(tokenizer, sample: Sample) -> str:
    """What the reward reads: the response decoded, a multi-turn episode's tool output left
    out (each run of the model's tokens decoded alone, joined: a tool that prints an answer
    cannot answer for the model)."""
    from itertools import groupby

    if TOOL_VERSION not in sample.versions:
        return tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    runs = groupby(zip(sample.response_ids, sample.versions), key=lambda t: t[1] == TOOL_VERSION)
    return "".join(
        tokenizer.decode([i for i, _ in run], skip_special_tokens=True)
        for tool, run in runs
        if not tool
    )


def record_pass_rates(run: Run, groups: list[Group]) -> None:
    """No-Positive-Resampling history: the scored groups' rewards, trained on or dropped."""
    if run.tracker is not None:
        ids = [g.prompt_id for g in groups for _ in g.rewards]
        run.tracker.update(ids, [r for g in groups for r in g.rewards])


def score_groups(run: Run, groups: list[Group], version: int) -> tuple[list[TrainSample], dict]:
    """Rewards for every sample, pass-rate history (No-Positive-Resampling), batch stats."""
    reward_groups(run, groups)  # those that dynamic sampling has not scored already
    record_pass_rates(run, groups)
    flat = [(g, i, s, r) for i, g in enumerate(groups) for s, r in zip(g.samples, g.rewards)]
    prompts = [run.data.get(g.prompt_id) for g, _, _, _ in flat]
    rewards = [r for _, _, _, r in flat]
    samples = [
        TrainSample(
            prompt_id=g.prompt_id,
            group=i,
            prompt_tokens=list(s.prompt_ids),
            response_tokens=list(s.response_ids),
            gen_logprobs=list(s.logprobs),
            policy_mask=list(s.mask),
            reward=r,
            versions=list(s.versions),
            truncated=s.finish_reason == "length",
            interrupted=s.interrupted,
            routed_experts=s.routed_experts,
        )
        for g, i, s, r in flat
    ]
    # staleness of the policy's tokens: a tool's (TOOL_VERSION) were made by no policy
    lags = [version - v for _, _, s, _ in flat if (v := s.oldest_version) is not None]
    n = max(len(samples), 1)
    info = {
        "reward_mean": sum(s.reward for s in samples) / n,
        "pass_rate": sum(s.reward > 0 for s in samples) / n,
        "truncation_rate": sum(s.truncated for s in samples) / n,
        "interruption_rate": sum(s.interrupted for s in samples) / n,
        "response_tokens": sum(len(s.response_tokens) for s in samples),
        "staleness_mean": sum(lags) / max(len(lags), 1),
        "staleness_max": max(lags, default=0),
        "samples": len(samples),
        # Verifications that ran out of time score incorrect; counted so they never pass
        # for wrong answers unseen.
        "reward_timeouts": sum(g.reward_timeouts for g in groups),
        # Of them, programs stopped by the code sandbox's wall-clock backstop (no verdict).
        "reward_timeouts_wall": sum(g.reward_timeouts_wall for g in groups),
        # Responses whose scoring failed (scored incorrect, the run goes on below
        # reward.max_error_fraction), and reward workers that died (their item ran again).
        "reward_errors": sum(g.reward_errors for g in groups),
        "reward_crashes": sum(g.reward_crashes for g in groups),
        "prompt_ids": [g.prompt_id for g in groups],
        "group_pass_rates": [
            sum(s.reward > 0 for s in samples if s.group == i) / max(len(g.samples), 1)
            for i, g in enumerate(groups)
        ],
    }
    if len(run.data.sources) > 1:  # a mixture: the training reward of each domain too
        info.update(by_domain("reward_mean", [p.kind for p in prompts], rewards, mean=True))
    if run.config.rollout.episodes:  # multi-turn episodes: their tool use
        info.update(episode_metrics([s for _, _, s, _ in flat], rewards))
    return samples, info


def by_domain(key: str, domains: list[str], rewards: list[float], mean: bool) -> dict:
    """``{key/<domain>: mean reward (mean) or pass rate}`` over the items of each domain."""
    out = {}
    for domain in dict.fromkeys(domains):
        values = [r for d, r in zip(domains, rewards) if d == domain]
        out[f"{key}/{domain}"] = (
            sum(values) / len(values) if mean else sum(r > 0 for r in values) / len(values)
        )
    return out


def episode_metrics(samples: list[Any], rewards: list[float]) -> dict[str, float]:
    """A step's multi-turn metrics over its episodes (``rollout.samples.Sample``, their tool
    calls in ``Sample.tools``) and their ``rewards``. ``turns_mean``: model turns per episode
    (a turn follows each tool output); ``tool_calls``, ``tool_errors``, ``tool_timeouts``,
    ``tool_truncated``, ``tool_seconds`` (summed over the step); ``tool_episode_fraction``:
    the share of episodes with a call; ``tool_token_share``: the share of response tokens a
    tool wrote; ``pass_rate_with_tool`` / ``_without_tool``: the pass rate of the episodes
    with / without a call (NaN when there are none)."""
    turns = tool_tokens = tokens = 0
    for sample in samples:
        versions = sample.versions
        tool_tokens += sum(v == TOOL_VERSION for v in versions)
        tokens += len(versions)
        # a model turn starts at the response's start and after each run of tool tokens
        turns += int(bool(versions) and versions[0] != TOOL_VERSION) + sum(
            a == TOOL_VERSION and b != TOOL_VERSION for a, b in zip(versions, versions[1:])
        )
    calls = [call for sample in samples for call in sample.tools]
    used = [r > 0 for s, r in zip(samples, rewards) if s.tools]
    unused = [r > 0 for s, r in zip(samples, rewards) if not s.tools]
    return {
        "turns_mean": turns / max(len(samples), 1),
        "tool_calls": float(len(calls)),
        "tool_errors": float(sum(outcome == "error" for outcome, _ in calls)),
        "tool_timeouts": float(sum(outcome == "timeout" for outcome, _ in calls)),
        "tool_truncated": float(sum(outcome == "truncated" for outcome, _ in calls)),
        "tool_seconds": float(sum(seconds for _, seconds in calls)),
        "tool_episode_fraction": len(used) / max(len(samples), 1),
        "tool_token_share": tool_tokens / max(tokens, 1),
        "pass_rate_with_tool": sum(used) / len(used) if used else float("nan"),
        "pass_rate_without_tool": sum(unused) / len(unused) if unused else float("nan"),
    }

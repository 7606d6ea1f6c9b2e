"""The keys a run writes to ``metrics.jsonl``: one registry, key -> (meaning, unit).

``MetricsLogger.log`` checks every record's keys against it (an unknown key is logged once as
a warning: a record is never lost for a missing description), the tests check that every key
of the tiny runs' records is here, and ``tools/gen_docs.py`` writes ``docs/metrics.md`` from it.
Imports nothing heavy.

Keys with a variable part are patterns: ``<domain>`` (a data source's domain, e.g. ``math``),
``<status>`` and ``<name>`` stand for one path segment.
"""

from __future__ import annotations

import re
from functools import lru_cache

# key -> (meaning, unit). Unit "" means a dimensionless number, count or flag as said.
STEP: dict[str, tuple[str, str]] = {
    "step": ("the update the record belongs to (0: before the first update)", "step"),
    "samples": ("samples the update trained on", "samples"),
    "response_tokens": ("response tokens of the step's samples", "tokens"),
    "reward_mean": ("mean reward of the step's samples", "reward"),
    "reward_mean/<domain>": ("mean training reward of one domain's samples (a mixture)", "reward"),
    "pass_rate": ("fraction of the step's samples with reward > 0", "fraction"),
    "truncation_rate": ("fraction of samples cut at the length limit", "fraction"),
    "interruption_rate": ("fraction of samples forcibly interrupted (thinking budget)", "fraction"),
    "staleness_mean": (
        "mean lag of the samples: trainer version - oldest token version",
        "versions",
    ),
    "staleness_max": ("largest lag of a sample in the step", "versions"),
    "staleness_hist": (
        "policy-generated tokens by lag i = 0..k (made by version - i)",
        "tokens per lag",
    ),
    "reward_timeouts": ("verifications that ran out of time (scored incorrect)", "count"),
    "reward_timeouts_wall": (
        "of them, programs stopped by the sandbox's wall-clock backstop",
        "count",
    ),
    "reward_errors": (
        "responses whose scoring failed (the verifier raised, the sandbox failed, or a worker "
        "died twice): scored incorrect; over reward.max_error_fraction of a batch stops the run",
        "count",
    ),
    "reward_crashes": (
        "reward worker processes that died verifying the step's responses (each response "
        "runs again once)",
        "count",
    ),
    "turns_mean": ("multi-turn episodes: model turns per episode", "turns"),
    "tool_calls": ("multi-turn episodes: tool calls made in the step's episodes", "count"),
    "tool_errors": ("of them, calls that failed or could not be read", "count"),
    "tool_timeouts": ("of them, calls stopped at rollout.environment.tool_timeout_s", "count"),
    "tool_truncated": ("of them, calls whose output was cut to the output limits", "count"),
    "tool_seconds": ("time the step's tool calls took, summed", "s"),
    "tool_episode_fraction": ("fraction of the step's episodes with a tool call", "fraction"),
    "tool_token_share": ("fraction of response tokens a tool wrote (no loss on them)", "fraction"),
    "pass_rate_with_tool": ("pass rate of the episodes with a tool call (NaN: none)", "fraction"),
    "pass_rate_without_tool": ("pass rate of the episodes without one (NaN: none)", "fraction"),
    "prompt_ids": ("the step's prompt ids, one per group", "ids"),
    "group_pass_rates": ("each group's fraction of samples with reward > 0", "fractions"),
    "generator_version": ("policy version the generator holds when the batch is formed", "version"),
    "prompts_drawn": ("prompts drawn from the sampler for this step", "prompts"),
    "groups_kept": ("dynamic sampling: groups kept", "groups"),
    "groups_dropped": ("dynamic sampling: zero-variance groups dropped and replaced", "groups"),
    "groups_kept_over_cap": (
        "dynamic sampling: zero-variance groups kept past the round cap",
        "groups",
    ),
    "effective_batch_fraction": ("fraction of groups with non-zero reward variance", "fraction"),
    "npr_retired": ("prompts retired by No-Positive-Resampling so far", "prompts"),
    "loss": ("the policy loss of the update", "loss"),
    "grad_norm": ("global gradient norm before clipping", "norm"),
    "lr": ("learning rate of the update", "1"),
    "rho_mean": ("mean importance ratio trainer / generator on tokens with a loss", "ratio"),
    "rho_max": ("largest importance ratio", "ratio"),
    "clip_frac": ("fraction of tokens whose ratio was clipped", "fraction"),
    "abs_logprob_diff": ("mean |trainer - generator log-prob| on tokens with a loss", "nats"),
    "logprob_gap": ("mean |log-prob gap| on samples of the trainer's current version", "nats"),
    "logprob_gap_tokens": ("tokens the logprob_gap was measured on", "tokens"),
    "mismatch_kl": ("k3 KL generator vs trainer on tokens with a loss (NaN: none)", "nats"),
    "is_weight_mean": ("mean weight of the mismatch correction", "weight"),
    "is_weight_max": ("largest weight of the mismatch correction", "weight"),
    "mismatch_truncated_frac": (
        "fraction of tokens whose correction weight was truncated",
        "fraction",
    ),
    "mismatch_masked_frac": ("fraction of tokens masked by the correction", "fraction"),
    "recompute_seconds": (
        "mismatch_reference recompute: the pi_old forward over the round's batches (its "
        "first step; 0 on the others)",
        "s",
    ),
    "dp_token_imbalance": ("largest / mean tokens of a data-parallel rank", "ratio"),
    "train_tokens_per_s": ("tokens the update processed per second of update", "tokens/s"),
    "gen_tokens_per_s": ("response tokens per second of the whole step", "tokens/s"),
    "gen_wait_seconds": ("time the trainer waited for the batch", "s"),
    "step_seconds": ("wall time of the step", "s"),
    "policy_version": ("the generator pool's weight version after the step", "version"),
    "engine_restarts": ("engines that died and were restarted so far", "count"),
    "push_seconds": ("time of the step's weight push", "s"),
    "push_gb_per_s": ("the push's bytes per second", "GB/s"),
    "pool_occupancy": ("time-averaged sequences in flight / pool capacity", "fraction"),
    "sequences_in_flight": (
        "time-averaged sequences in flight (a pool without a capacity)",
        "sequences",
    ),
    "generator_idle_fraction": ("fraction of the step with no sequence in flight", "fraction"),
    "engine_idle_fraction_mean": (
        "mean over engines of each engine's idle fraction (of the step with no request "
        "generating: an episode waiting on a tool call does not count)",
        "fraction",
    ),
    "engine_idle_fraction_max": ("the idlest engine's idle fraction", "fraction"),
    "logprob_probe_gap": ("mean |gap| of the post-push probe's samples", "nats"),
    "logprob_probe_max_gap": ("largest per-token |gap| of the probe", "nats"),
    "logprob_probe_tokens": ("tokens the probe measured", "tokens"),
    "logprob_probe_seconds": ("time the probe took", "s"),
    "moe/load_ratio_max": ("worst layer's max / mean tokens per expert", "ratio"),
    "moe/load_ratio_mean": ("mean over layers of max / mean tokens per expert", "ratio"),
    "moe/router_entropy": ("mean router entropy over layers", "nats"),
    "moe/dropped_fraction": (
        "fraction of top-k choices dropped by the capacity factor",
        "fraction",
    ),
    "moe/tokens": ("tokens each MoE layer routed (mean over layers)", "tokens"),
    "moe/<name>": ("megatron-core's router aux / z loss, mean over layers (when on)", "loss"),
}

GPU_HOURS: dict[str, tuple[str, str]] = {
    # docs/scaling.md: device-time (GPU: wall x devices; CPU: CPU time of the work processes)
    "gpu_hours": ("training compute so far: generation and training of training samples", "GPU-h"),
    "total_gpu_hours": ("the whole bill so far: every category", "GPU-h"),
    "startup_gpu_hours": ("start-up (build, warm start, engines, first push)", "GPU-h"),
    "validation_gpu_hours": (
        "validation passes (less training requests decoded meanwhile)",
        "GPU-h",
    ),
    "checkpoint_gpu_hours": ("checkpoint saves", "GPU-h"),
    "shutdown_gpu_hours": ("shutdown", "GPU-h"),
}

VALIDATION: dict[str, tuple[str, str]] = {
    "val_pass_rate": ("mean@G pass rate on the held-out prompts", "fraction"),
    "val_pass_rate/<domain>": ("one domain's validation pass rate (a mixture)", "fraction"),
    "val_samples": ("samples the validation scored", "samples"),
    "val_reward_timeouts": ("validation verifications that ran out of time", "count"),
    "val_reward_timeouts_wall": ("of them, stopped by the sandbox's wall-clock backstop", "count"),
    "val_reward_errors": ("validation responses whose scoring failed (scored incorrect)", "count"),
    "val_reward_crashes": ("reward worker processes that died in the validation pass", "count"),
    "val_train_fraction": ("token share of the validation window counted as training", "fraction"),
    "val_seconds": ("wall time of the validation pass", "s"),
}

FORECAST: dict[str, tuple[str, str]] = {
    "forecast_step": ("the validation step the forecast was fitted at", "step"),
    "forecast_A": ("fitted asymptotic pass rate A", "fraction"),
    "forecast_B": ("fitted scaling exponent B", "1"),
    "forecast_C_mid": ("fitted compute at half the gain", "GPU-h"),
    "forecast_R0": ("pass rate at zero compute (the fit's start)", "fraction"),
    "forecast_pass_rate_at_budget": ("predicted pass rate at the budget", "fraction"),
    "forecast_budget_gpu_hours": ("the budget the forecast extrapolates to", "GPU-h"),
    "forecast_points": ("validation points fitted", "points"),
    "forecast_x_last": ("compute of the last point fitted", "GPU-h"),
    "forecast_A_lo": ("bootstrap lower bound of A", "fraction"),
    "forecast_A_hi": ("bootstrap upper bound of A", "fraction"),
    "forecast_B_lo": ("bootstrap lower bound of B", "1"),
    "forecast_B_hi": ("bootstrap upper bound of B", "1"),
    "forecast_C_mid_lo": ("bootstrap lower bound of C_mid", "GPU-h"),
    "forecast_C_mid_hi": ("bootstrap upper bound of C_mid", "GPU-h"),
    "forecast_pass_rate_at_budget_lo": ("lower bound of the prediction at the budget", "fraction"),
    "forecast_pass_rate_at_budget_hi": ("upper bound of the prediction at the budget", "fraction"),
    "forecast_at_bound": ("parameters the fit left at a bound of its grid", "names"),
}
# Every forecast key also comes per domain (a mixture): forecast_*/<domain>.
FORECAST.update(
    {f"{k}/<domain>": (f"{v[0]} (one domain)", v[1]) for k, v in list(FORECAST.items())}
)
del FORECAST["forecast_step/<domain>"]

OTHER: dict[str, tuple[str, str]] = {
    "warm_start_loss": ("last loss of the supervised warm start (record of step 0)", "loss"),
    "run_finished": ("the run ended normally (its last record)", "flag"),
}

METRICS: dict[str, tuple[str, str]] = {**STEP, **GPU_HOURS, **VALIDATION, **FORECAST, **OTHER}
SECTIONS: tuple[tuple[str, dict[str, tuple[str, str]]], ...] = (
    ("Step records (one per update)", STEP),
    ("GPU-hours (in every record)", GPU_HOURS),
    ("Validation records", VALIDATION),
    ("Live forecast records (after each validation)", FORECAST),
    ("Other records", OTHER),
)

_PLACEHOLDER = re.compile(r"<[a-z]+>")


@lru_cache(maxsize=1)
def _patterns() -> tuple[re.Pattern[str], ...]:
    return tuple(
        re.compile("^" + _PLACEHOLDER.sub("[^/]+", re.escape(k)) + "$")
        for k in METRICS
        if _PLACEHOLDER.search(k)
    )


@lru_cache(maxsize=4096)
def is_known(key: str) -> bool:
    """Whether ``key`` is a registered metric (exactly or through a pattern)."""
    return key in METRICS or any(p.match(key) for p in _patterns())


def unknown(keys) -> list[str]:
    """The keys of ``keys`` the registry does not describe, sorted."""
    return sorted(k for k in keys if not is_known(k))


def markdown() -> str:
    """``docs/metrics.md``: every key with meaning and unit, by section."""
    lines = [
        "# Metrics reference",
        "",
        "<!-- Generated by tools/gen_docs.py from megatron_rl/trainer/metric_keys.py;",
        "     do not edit by hand (tests/unit/project/test_docs.py fails when it is stale). -->",
        "",
        "Every key a run writes to `RUN_DIR/metrics.jsonl` (also TensorBoard and W&B).",
        "`<domain>` stands for a data source's domain (`math`, `code`) in a mixture; `<name>`",
        "for a router loss's name. TensorBoard also gets the per-layer series",
        "`moe/layer_NN/...` (tokens per expert, load ratio, entropy, dropped fraction).",
        "",
    ]
    for title, table in SECTIONS:
        lines += [f"## {title}", "", "| key | meaning | unit |", "|---|---|---|"]
        lines += [f"| `{k}` | {m} | {u} |" for k, (m, u) in table.items()]
        lines.append("")
    return "\n".join(lines)

"""One policy update: advantages and filters, log-probs with the FP32 head, loss, optimizer step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.algorithms import (
    compute_advantages,
    compute_loss_normalizers,
    length_penalty,
    policy_loss,
    zero_variance_mask,
)
from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.models.logprobs import token_logprobs
from megatron_rl.trainer.batch import TrainSample, flat_response_tensors, make_micro_batches


@dataclass
class StepResult:
    """What one update measured (plain floats, for metrics)."""

    loss: float
    grad_norm: float
    effective_batch_fraction: float
    rho_mean: float
    rho_max: float
    clip_frac: float
    abs_logprob_diff: float
    num_tokens: int


def shaped_rewards(samples: Sequence[TrainSample], algo: AlgorithmConfig) -> torch.Tensor:
    """``[S]`` rewards, with the length penalty added on correct samples when enabled."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if algo.length_penalty:
        lengths = torch.tensor([len(s.response_tokens) for s in samples])
        rewards = rewards + length_penalty(
            lengths, rewards > 0, algo.length_penalty_l_max, algo.length_penalty_l_cache
        )
    return rewards


def advantages_and_keep(samples: Sequence[TrainSample], algo: AlgorithmConfig):
    """``[S]`` advantages and the ``[S]`` kept mask (zero-variance filtering)."""
    rewards = shaped_rewards(samples, algo)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    keep = (
        zero_variance_mask(rewards, groups)
        if algo.zero_variance_filter
        else torch.ones(len(samples), dtype=torch.bool)
    )
    adv = compute_advantages(rewards, groups, normalization=algo.advantage_normalization, keep=keep)
    return adv, keep


def policy_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[TrainSample],
    algo: AlgorithmConfig,
    micro_batch_size: int,
    grad_clip: float = 1.0,
    dp_group=None,
    temperature: float = 1.0,
) -> StepResult:
    """Compute the loss over all samples in micro-batches, backward, clip, step."""
    adv, keep = advantages_and_keep(samples, algo)
    flat = flat_response_tensors(samples, adv, keep)
    norms = compute_loss_normalizers(flat["mask"], flat["sid"], flat["pid"], group=dp_group)
    params = algo.loss_params()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = {"loss": 0.0, "rho_sum": 0.0, "rho_max": 0.0, "clip": 0.0, "absdiff": 0.0, "n": 0}
    for mb in make_micro_batches(samples, adv, keep, micro_batch_size):
        logprobs = token_logprobs(model, mb.tokens, temperature)[mb.select]
        loss, stats = policy_loss(
            algo.loss,
            logprobs,
            mb.gen_logprobs,
            mb.advantages,
            mb.loss_mask,
            mb.sample_ids,
            mb.prompt_ids,
            aggregation=algo.aggregation,
            normalizers=norms,
            **params,
        )
        if mb.loss_mask.any():
            loss.backward()
        n = int(stats["num_tokens"])
        totals["loss"] += float(loss)
        totals["n"] += n
        totals["rho_sum"] += float(stats["rho_mean"]) * n
        totals["clip"] += float(stats["clip_frac"]) * n
        totals["absdiff"] += float(stats["abs_log_ratio_mean"]) * n
        if n:
            totals["rho_max"] = max(totals["rho_max"], float(stats["rho_max"]))
    if dp_group is not None:
        for p in model.parameters():
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad, group=dp_group)  # SUM, see aggregation.py
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf))
    if totals["n"]:
        optimizer.step()
    n = max(totals["n"], 1)
    return StepResult(
        loss=totals["loss"],
        grad_norm=grad_norm,
        effective_batch_fraction=float(keep.float().mean()) if len(samples) else 0.0,
        rho_mean=totals["rho_sum"] / n,
        rho_max=totals["rho_max"],
        clip_frac=totals["clip"] / n,
        abs_logprob_diff=totals["absdiff"] / n,
        num_tokens=totals["n"],
    )

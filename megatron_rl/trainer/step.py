"""One policy update: advantages and filters, log-probs with the FP32 head, loss, optimizer step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    """Compute the loss over the samples in micro-batches, backward, clip, step.

    ``samples`` is the whole step's batch on every rank. With a data-parallel group, each DP
    rank trains on the groups ``g`` with ``g % dp_size == dp_rank``; advantages and loss
    normalisers are those of the whole batch, and gradients are summed over the group.
    """
    adv, keep = advantages_and_keep(samples, algo)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        size, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        mine = [i for i, s in enumerate(samples) if s.group % size == rank]
        samples = [samples[i] for i in mine]
        adv, keep, ids = adv[mine], keep[mine], mine
    else:
        dp_group, ids = None, list(range(len(samples)))
    flat = flat_response_tensors(samples, adv, keep, ids)
    norms = compute_loss_normalizers(flat["mask"], flat["sid"], flat["pid"], group=dp_group)
    params = algo.loss_params()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = {"loss": 0.0, "rho_sum": 0.0, "rho_max": 0.0, "clip": 0.0, "absdiff": 0.0, "n": 0}
    for mb in make_micro_batches(samples, adv, keep, micro_batch_size, ids=ids):
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
        # Every rank reduces every parameter (a rank whose groups all had zero variance has
        # no gradients of its own), in the same order: a SUM, see algorithms/aggregation.py.
        for p in model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad, group=dp_group)
    grad_norm = clip_grad_norm(model, grad_clip)
    if norms.num_tokens:  # global count: every rank steps, or none does
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


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip by the global gradient norm over the model-parallel group; returns the norm.

    Tensor-parallel shards count once each, replicated parameters once in all (megatron marks
    shards with ``tensor_model_parallel``). megatron's own ``get_grad_norm_fp32`` allocates
    on ``device='cuda'``, so it cannot serve the CPU path.
    """
    from megatron.core import parallel_state

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    square = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for p in model.parameters():
        if p.grad is not None and (getattr(p, "tensor_model_parallel", False) or tp_rank == 0):
            square += p.grad.float().pow(2).sum()
    if dist.is_initialized() and parallel_state.get_model_parallel_group().size() > 1:
        dist.all_reduce(square, group=parallel_state.get_model_parallel_group())
    norm = float(square.sqrt())
    if max_norm and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm

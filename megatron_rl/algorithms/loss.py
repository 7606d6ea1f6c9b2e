"""``policy_loss``: one call from the trainer per micro-batch."""

from __future__ import annotations

import inspect

import torch

from megatron_rl.algorithms.aggregation import (
    AGGREGATIONS,
    LossNormalizers,
    check_token_inputs,
    compute_loss_normalizers,
)
from megatron_rl.algorithms.losses import LOSSES
from megatron_rl.algorithms.mismatch import MismatchCorrection, MismatchWeights, mismatch_kl


def _check_float_inputs(loss_mask: torch.Tensor, **values: torch.Tensor) -> None:
    for name, value in values.items():
        if value.shape != loss_mask.shape:
            raise ValueError(
                f"{name} must have the shape of loss_mask {tuple(loss_mask.shape)}, got "
                f"{tuple(value.shape)}"
            )
        if not value.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")


def policy_loss(
    kind: str,
    logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    prompt_ids: torch.Tensor,
    aggregation: str = "prompt",
    normalizers: LossNormalizers | None = None,
    mismatch: MismatchCorrection | None = None,
    old_logprobs: torch.Tensor | None = None,
    **params: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated policy loss of one micro-batch (tokens flattened over its samples).

    loss = - sum_t w_t * obj_t, with obj_t the per-token objective of ``kind`` (see
    ``LOSSES``) and w_t the weights of ``aggregation`` (see ``aggregation.py``). With
    ``normalizers`` from ``compute_loss_normalizers`` over the whole step, the losses of all
    micro-batches and data-parallel ranks sum to the full-batch loss; without, the given
    tokens are the whole batch.

    With a ``mismatch`` correction (not ``none``), the loss's ratio is taken against the
    trainer's own log-probs (``logprobs`` detached: the proximal policy of a one-step
    update) and each token's objective is multiplied by the correction's weight of
    r = exp(logprobs - gen_logprobs); see ``megatron_rl.algorithms.mismatch``.

    With ``old_logprobs`` (pi_old: the trainer's recompute at the weights that generated the
    samples, ``algorithm.mismatch_reference: recompute``) they take the place of the
    detached ``logprobs`` in both: the loss's ratio is pi_theta / pi_old (the staleness,
    inside the loss's clip) and the correction's r = pi_old / pi_gen (the mismatch alone),
    with or without a correction (verl's three policies; ``mismatch_kl`` then measures
    pi_old against pi_gen too).

    Args:
        kind: loss name, a key of ``LOSSES`` ("cispo", "ppo_clip", "gspo", "reinforce").
        logprobs: ``[T]`` trainer log-probs of the sampled tokens (requires grad).
        gen_logprobs: ``[T]`` generator log-probs of the same tokens.
        advantages: ``[T]`` advantage of each token's sample.
        loss_mask: ``[T]`` bool, policy tokens of kept samples.
        sample_ids: ``[T]`` long, id of each token's sample (unique in the global batch).
        prompt_ids: ``[T]`` long, id of each token's prompt (unique in the global batch).
        aggregation: "prompt", "sample" or "token".
        normalizers: global counts of the step; None computes them from these tokens.
        mismatch: the train-inference mismatch correction; None: none.
        old_logprobs: ``[T]`` pi_old of the same tokens, or None (pi_prox = ``logprobs``).
        **params: hyper-parameters of the loss (eps_max; eps_low, eps_high).

    Returns:
        The scalar loss and detached 0-dim statistics over this micro-batch's masked
        tokens: rho_mean, rho_max, clip_frac (clipped, or truncated for CISPO),
        abs_log_ratio_mean (mean |logprobs - gen_logprobs|), num_tokens, weight_sum (sums
        to 1 over the step's micro-batches and ranks when any token is masked), loss;
        mismatch_kl (mean k3 KL(generator || trainer), also without a correction),
        is_weight_mean / is_weight_max (the correction's weights; 1 without one),
        truncated_frac / masked_frac (tokens whose weight the correction truncated / zeroed).
    """
    if kind not in LOSSES:
        raise ValueError(f"loss kind must be one of {list(LOSSES)}, got {kind!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}")
    check_token_inputs(loss_mask, sample_ids=sample_ids, prompt_ids=prompt_ids)
    _check_float_inputs(
        loss_mask, logprobs=logprobs, gen_logprobs=gen_logprobs, advantages=advantages
    )
    if old_logprobs is not None:
        _check_float_inputs(loss_mask, old_logprobs=old_logprobs)
    accepted = set(inspect.signature(LOSSES[kind]).parameters)
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(f"loss {kind!r} takes parameters {sorted(accepted)}, got {unknown}")
    loss_fn = LOSSES[kind](**params)
    if normalizers is None:
        normalizers = compute_loss_normalizers(loss_mask, sample_ids, prompt_ids)
    weights = normalizers.token_weights(aggregation, loss_mask, sample_ids, prompt_ids)
    weights = weights.to(logprobs.dtype)
    # Zero everything outside the mask first: padding may hold -inf / nan log-probs, which
    # would turn 0 * inf into nan in the forward or backward pass.
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    logprobs = torch.where(loss_mask, logprobs, zero)
    gen_logprobs = torch.where(loss_mask, gen_logprobs.detach().to(logprobs.dtype), zero)
    advantages = torch.where(loss_mask, advantages.detach().to(logprobs.dtype), zero)
    correction = mismatch if mismatch is not None else MismatchCorrection()
    # The trainer's side of the mismatch: pi_old recomputed at the generator's weights, or
    # the update's own forward (pi_prox, detached).
    if old_logprobs is None:
        trainer = logprobs.detach()
    else:
        trainer = torch.where(loss_mask, old_logprobs.detach().to(logprobs.dtype), zero)
    corrected = correction.weights(trainer, gen_logprobs, loss_mask, sample_ids, normalizers)
    # The ratio's reference: the generator's log-probs, or with a correction (or a recompute)
    # the trainer's own (pi_theta / pi_prox or pi_old: the correction carries the rest of
    # pi_theta / pi_gen, counted once).
    decoupled = correction.decoupled or old_logprobs is not None
    reference = trainer if decoupled else gen_logprobs
    terms = loss_fn.terms(logprobs, reference, advantages, loss_mask, sample_ids, normalizers)
    objective = terms.objective
    if correction.decoupled:
        objective = corrected.weights.to(objective.dtype) * objective
    loss = -(weights * torch.where(loss_mask, objective, zero)).sum()
    stats = _stats(logprobs, gen_logprobs, loss_mask, terms.clipped, weights, loss)
    stats.update(_mismatch_stats(trainer, gen_logprobs, loss_mask, corrected))
    return loss, stats


@torch.no_grad()
def _stats(
    logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    clipped: torch.Tensor,
    weights: torch.Tensor,
    loss: torch.Tensor,
) -> dict[str, torch.Tensor]:
    log_ratio = (logprobs - gen_logprobs).float()  # 0 outside the mask
    rho = torch.exp(log_ratio)
    num = loss_mask.sum()
    denom = num.clamp(min=1).float()
    masked_rho = torch.where(loss_mask, rho, torch.zeros_like(rho))
    return {
        "rho_mean": masked_rho.sum() / denom,
        "rho_max": masked_rho.max() if rho.numel() else rho.new_zeros(()),
        "clip_frac": (clipped & loss_mask).sum().float() / denom,
        "abs_log_ratio_mean": log_ratio.abs().sum() / denom,
        "num_tokens": num,
        "weight_sum": weights.sum().detach(),
        "loss": loss.detach(),
    }


@torch.no_grad()
def _mismatch_stats(
    logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    corrected: MismatchWeights,
) -> dict[str, torch.Tensor]:
    denom = loss_mask.sum().clamp(min=1).float()
    w = torch.where(loss_mask, corrected.weights.float(), torch.zeros((), device=loss_mask.device))
    return {
        "mismatch_kl": (mismatch_kl(logprobs, gen_logprobs, loss_mask).sum() / denom).float(),
        "is_weight_mean": w.sum() / denom,
        "is_weight_max": w.max() if w.numel() else w.new_zeros(()),
        "truncated_frac": corrected.truncated.sum().float() / denom,
        "masked_frac": corrected.masked.sum().float() / denom,
    }

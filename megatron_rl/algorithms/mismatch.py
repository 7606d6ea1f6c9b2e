"""Train-inference mismatch: its measure (k3 KL) and its correction (TIS, MIS, IcePop).

The generator (vLLM: other kernels, bf16 or FP8 weights, a stale KV cache in PipelineRL) and
the trainer give the same sampled token different probabilities. Three policies meet in an
update (notation of verl's rollout correction and of AReaL's decoupled PPO):

- ``pi_gen``: the behaviour policy, the generator's log-probs sent with each token
  (``gen_logprobs``; in PipelineRL a sample may span several policy versions);
- ``pi_prox``: the trainer's own policy at the weights the update starts from (AReaL's
  proximal policy; verl's and slime's "old" log-probs, a trainer recompute);
- ``pi_theta``: the policy being optimised (``logprobs``, with grad).

**What the correction multiplies.** Without a correction (``mismatch: none``, the paper's
recipes) the losses' importance ratio is ``rho = pi_theta / pi_gen``: the "old" log-probs of
CISPO / PPO-clip / GSPO are the generator's, so the ratio already carries both the staleness
and the train-inference mismatch (CISPO's ``sg(min(rho, eps_max))`` is a token-level TIS with
C = eps_max; PPO-clip clips tokens out of its trust region for mismatch as for staleness).
A mismatch weight on top of that ratio would count the mismatch twice: slime refuses
``--use-tis`` with ``--use-rollout-logprobs`` (slime/utils/arguments.py) and verl's bypass
mode applies no IS weight to PPO-clip for that reason (verl/trainer/ppo/core_algos.py,
``compute_policy_loss_bypass_mode``). So a correction **decouples** the ratio:

    rho = pi_theta / pi_gen = (pi_theta / pi_prox) * (pi_prox / pi_gen)
    objective_t = w_t * loss_objective_t(ratio pi_theta / pi_prox),  w_t = f(pi_prox / pi_gen)

with ``w`` detached and ``f`` the correction below. Every update here is one optimizer step
on its batch (PipelineRL-k and PPO-off-policy-k alike), so ``pi_prox`` is the weights of the
update's own forward and its log-probs are that forward's, detached: the trainer recompute
costs no extra forward (slime does the same when no recompute is stored:
``old_log_probs = log_prob.detach()`` in ``policy_loss_function``, and TIS then uses those).
The loss ratio ``pi_theta / pi_prox`` is 1 in value, so every loss reduces to
``w_t * A * grad log pi_theta`` and the correction alone bounds the update (in PipelineRL
``pi_prox / pi_gen`` includes the staleness too, as AReaL's behaviour weight does). This is
AReaL's decoupled objective with its proximal policy; the extra forward AReaL spends on the
recompute (it takes several optimizer steps per batch) is none here
(tests/unit/trainer/test_trainer_step.py checks the log-probs against a separate forward and
counts the forwards).

**verl's three policies** (``algorithm.mismatch_reference: recompute``, PPO-off-policy-k
only). The ``update`` reference above folds the staleness into the correction. The
``recompute`` one separates them: before a round's first update the trainer runs one
no-grad forward over the round's k batches at the weights that generated them (the round's
starting weights: the pool generates the k batches with one version and is idle during the
k updates; ``trainer.step.recompute_old_logprobs``, the update's own forward path) and
stores ``pi_old``. Each update then takes

    objective_t = f(pi_old / pi_gen) * loss_objective_t(ratio pi_theta / pi_old)

so the correction is the train-inference mismatch alone and the loss's ratio carries the
staleness inside its clip (verl: ``old_log_prob`` recomputed by the actor,
``compute_rollout_correction_weights(old_log_prob, rollout_log_prob)`` and
``compute_policy_loss_vanilla(old_log_prob, log_prob, ..., rollout_is_weights)``). It
costs one extra forward per batch (the ``recompute_seconds`` metric; measured by
tools/bench_train_step.py). PipelineRL's samples span versions whose weights are gone, so
the config refuses it there. At a round's first update pi_old is the update's own forward
and the two references give the same loss.

**The corrections** (``r = pi_prox / pi_gen``, or ``pi_old / pi_gen``, at ``level``: per
token; ``sequence``: the product over the sample's tokens, exp(sum log r); ``geometric``:
exp(mean log r); the log ratio clamped to +-20 before exp as verl and slime do):

- ``tis``: ``w = min(r, C)`` (truncated importance sampling; verl
  ``compute_rollout_correction_weights``, rollout_is_threshold default 2; slime
  ``vanilla_tis_function``, ``--tis-clip`` default 2). Counted as truncated where r > C.
- ``mis``: ``w = r`` inside the band ``[low, high]``, 0 outside (masked importance sampling,
  rejection: slime examples/train_infer_mismatch_helper/mis.py ``mask``, verl's
  ``rollout_rs``; default band [0.5, 2], verl's lower bound 1 / upper). AReaL's decoupled PPO
  (``behav_imp_weight_cap``) is the one-sided band ``[0, cap]``.
- ``icepop``: ``mis`` at token level with IcePop's band [0.5, 2] (Ring-1T / IcePop; slime
  ``icepop_function``: ``where(low <= r <= high, r, 0)``).

A masked token keeps its share of the loss normalisers (its objective is 0), as in slime
(the denominators stay the per-rollout totals); verl also drops rejected tokens from its
token-mean denominators. Here the normalisers are counted before the forward.

Peers' source read: volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7
(verl/trainer/ppo/rollout_corr_helper.py, verl/trainer/ppo/core_algos.py), THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515
(slime/backends/megatron_utils/loss.py, examples/train_infer_mismatch_helper/mis.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_rl.algorithms.aggregation import LossNormalizers
from megatron_rl.algorithms.config import MISMATCH_LEVELS, MISMATCH_NAMES

# exp(+-20): the bound verl (rollout_corr_helper.SAFETY_BOUND) and slime (mis.py) put on a
# log ratio before exponentiating it.
SAFETY_BOUND = 20.0


@dataclass(frozen=True)
class MismatchWeights:
    """Per-token mismatch correction of one micro-batch.

    Attributes:
        weights: ``[T]`` detached weight of each token's objective (0 outside the loss mask;
            1 on every masked token with ``mismatch: none``).
        truncated: ``[T]`` bool, masked tokens whose weight was truncated (TIS: r > C).
        masked: ``[T]`` bool, masked tokens whose ratio left the band (MIS / IcePop: w = 0).
    """

    weights: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor


@dataclass(frozen=True)
class MismatchCorrection:
    """A mismatch correction (see the module docstring): ``mode`` one of MISMATCH_NAMES,
    ``level`` one of MISMATCH_LEVELS, ``low`` / ``high`` the band (``high``: TIS's cap C;
    ``low``: unused by TIS)."""

    mode: str = "none"
    level: str = "token"
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in MISMATCH_NAMES:
            raise ValueError(f"mismatch must be one of {list(MISMATCH_NAMES)}, got {self.mode!r}")
        if self.level not in MISMATCH_LEVELS:
            raise ValueError(
                f"mismatch level must be one of {list(MISMATCH_LEVELS)}, got {self.level!r}"
            )
        if not (math.isfinite(self.high) and self.high >= 1):
            raise ValueError(f"mismatch high must be a finite number >= 1, got {self.high!r}")
        if not 0 <= self.low <= 1:
            raise ValueError(f"mismatch low must be in [0, 1], got {self.low!r}")

    @property
    def decoupled(self) -> bool:
        """Whether the loss's ratio is taken against the trainer's own log-probs
        (``pi_theta / pi_prox``) instead of the generator's."""
        return self.mode != "none"

    def weights(
        self,
        trainer_logprobs: torch.Tensor,
        gen_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        sample_ids: torch.Tensor,
        normalizers: LossNormalizers | None = None,
    ) -> MismatchWeights:
        """The correction's weights on ``[T]`` tokens, from ``r = exp(trainer_logprobs -
        gen_logprobs)`` (the trainer's are detached here) at ``level``.

        A sequence or geometric level needs every masked token of a sample in these tokens:
        with ``normalizers`` (the step's counts) a split sample raises ValueError.
        """
        mask = loss_mask
        zero = torch.zeros((), dtype=trainer_logprobs.dtype, device=trainer_logprobs.device)
        if self.mode == "none":
            none = torch.zeros_like(mask)
            return MismatchWeights(torch.where(mask, 1.0 + zero, zero), none, none)
        log_ratio = torch.where(mask, trainer_logprobs.detach() - gen_logprobs.detach(), zero)
        if self.level != "token":
            sums, counts, index = _per_sample(log_ratio, mask, sample_ids, normalizers)
            if self.level == "geometric":
                sums = sums / counts.clamp(min=1).to(sums.dtype)
            log_ratio = sums[index]
        ratio = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        none = torch.zeros_like(mask)
        if self.mode == "tis":
            weights = ratio.clamp(max=self.high)
            truncated, masked = mask & (ratio > self.high), none
        else:  # mis, icepop: reject outside the band
            inside = (ratio >= self.low) & (ratio <= self.high)
            weights = torch.where(inside, ratio, zero)
            truncated, masked = none, mask & ~inside
        return MismatchWeights(torch.where(mask, weights, zero), truncated, masked)


def mismatch_kl(
    trainer_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """``[T]`` k3 estimate of KL(pi_gen || pi_trainer) per token, 0 outside ``loss_mask``:
    ``r - 1 - log r`` with ``r = pi_trainer / pi_gen`` on tokens sampled from pi_gen
    (Schulman's k3; verl ``compute_offpolicy_metrics`` ``k3_kl``). Its mean over the masked
    tokens is the ``mismatch_kl`` metric; it is >= 0 for each token."""
    zero = torch.zeros((), dtype=torch.float64, device=trainer_logprobs.device)
    log_ratio = torch.where(
        loss_mask, (trainer_logprobs.detach() - gen_logprobs.detach()).double(), zero
    )
    # expm1 - x in float64: r - 1 - log r is ~(log r)^2 / 2, far below float32's resolution
    # of log r near r = 1, where the tokens of a good weight path sit
    return torch.where(loss_mask, torch.expm1(log_ratio) - log_ratio, zero)


def _per_sample(
    values: torch.Tensor,
    mask: torch.Tensor,
    sample_ids: torch.Tensor,
    normalizers: LossNormalizers | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums of ``values`` (0 outside ``mask``) and masked-token counts per sample, and each
    token's sample index into them; ValueError where a sample's tokens are split."""
    _, index = torch.unique(sample_ids, return_inverse=True)
    num = int(index.max().item()) + 1 if index.numel() else 0
    sums = values.new_zeros(num).index_add(0, index, values)
    counts = torch.zeros(num, dtype=torch.int64, device=index.device)
    counts.index_add_(0, index, mask.to(torch.int64))
    if normalizers is not None:
        whole = normalizers.sample_token_counts(sample_ids, mask)
        if not bool(((counts[index] == whole) | ~mask).all()):
            raise ValueError(
                "a sequence-level mismatch correction needs all masked tokens of a sample in "
                "one micro-batch: split the batch by samples"
            )
    return sums, counts, index

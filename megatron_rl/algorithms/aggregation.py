"""Loss aggregation (prompt / sample / token average) with global normalisers.

Every aggregation is a weighted sum of per-token objectives, ``J = sum_t w_t * obj_t``, with

    token:   w_t = 1 / N                               N: masked tokens of the batch
    sample:  w_t = 1 / (num_samples * n_sample(t))     n_sample: masked tokens of t's sample
    prompt:  w_t = 1 / (num_prompts * n_prompt(t))     n_prompt: masked tokens of t's prompt

and w_t = 0 on tokens outside ``loss_mask``; samples and prompts without a masked token are
not counted. The counts are taken over the *global* batch of one optimizer step (all
micro-batches on all data-parallel ranks), so the loss is a plain sum over tokens and splits
exactly:

    # once per step, on each DP rank, over all tokens of the rank's micro-batches
    norm = compute_loss_normalizers(loss_mask, sample_ids, prompt_ids, group=dp_group)
    for mb in micro_batches:                       # any split by tokens or by samples
        loss, stats = policy_loss(kind, ..., mb.sample_ids, mb.prompt_ids,
                                  aggregation=agg, normalizers=norm)
        loss.backward()                            # no division by the number of micro-batches
    # gradients are then SUMMED over DP ranks (not averaged): all_reduce(SUM), or multiply
    # the loss by the DP size when the data-parallel reduction averages.

With Megatron-Core schedules, set ``TransformerConfig.calculate_per_token_loss=True`` (the
schedule then neither divides by the number of micro-batches nor averages over DP, and
``finalize_model_grads`` divides the summed gradients by the all-reduced token count that
``loss_func`` returns) and return ``(loss * norm.num_tokens, stats["num_tokens"], ...)`` from
``loss_func``: the token counts sum to ``norm.num_tokens`` over the step, which cancels the
factor exactly. With context parallelism the normalisers need the DP x CP group, and GSPO
(a per-sample mean) is not supported.

Sample ids and prompt ids must be unique within the global batch (e.g. the sample's and the
prompt's position in the step's batch), since ranks merge their counts by id. GSPO needs all
tokens of a sample in one micro-batch (split by samples); the other losses accept any split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_rl.algorithms.config import AGGREGATION_NAMES


@dataclass(frozen=True)
class LossNormalizers:
    """Global token counts of one optimizer step.

    Attributes:
        sample_keys: ``[Ns]`` sorted ids of the samples with at least one masked token.
        sample_tokens: ``[Ns]`` masked-token count of each of those samples.
        prompt_keys: ``[Np]`` sorted ids of the prompts with at least one masked token.
        prompt_tokens: ``[Np]`` masked-token count of each of those prompts.
        num_tokens: masked tokens in the global batch.
    """

    sample_keys: torch.Tensor
    sample_tokens: torch.Tensor
    prompt_keys: torch.Tensor
    prompt_tokens: torch.Tensor
    num_tokens: int

    @property
    def num_samples(self) -> int:
        """Samples of the global batch with at least one masked token."""
        return int(self.sample_keys.numel())

    @property
    def num_prompts(self) -> int:
        """Prompts of the global batch with at least one masked token."""
        return int(self.prompt_keys.numel())

    def sample_token_counts(
        self, sample_ids: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        """``[T]`` global masked-token count of each token's sample (0 where not masked)."""
        return _lookup(self.sample_keys, self.sample_tokens, sample_ids, loss_mask, "sample")

    def prompt_token_counts(
        self, prompt_ids: torch.Tensor, loss_mask: torch.Tensor
    ) -> torch.Tensor:
        """``[T]`` global masked-token count of each token's prompt (0 where not masked)."""
        return _lookup(self.prompt_keys, self.prompt_tokens, prompt_ids, loss_mask, "prompt")

    def token_weights(
        self,
        aggregation: str,
        loss_mask: torch.Tensor,
        sample_ids: torch.Tensor,
        prompt_ids: torch.Tensor,
    ) -> torch.Tensor:
        """``[T]`` float64 weights w_t of ``aggregation`` for a subset of the step's tokens."""
        if aggregation not in AGGREGATIONS:
            raise ValueError(
                f"aggregation must be one of {list(AGGREGATIONS)}, got {aggregation!r}"
            )
        return AGGREGATIONS[aggregation](self, loss_mask, sample_ids, prompt_ids)


def _lookup(
    keys: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, what: str
) -> torch.Tensor:
    if keys.numel() == 0:
        if bool(mask.any()):
            raise ValueError(f"masked tokens of a {what} missing from the normalizers")
        return torch.zeros_like(ids)
    pos = torch.searchsorted(keys, ids).clamp(max=keys.numel() - 1)
    found = keys[pos] == ids
    if not bool((found | ~mask).all()):
        missing = ids[mask & ~found][0].item()
        raise ValueError(
            f"{what} id {missing} has masked tokens but is missing from the normalizers; "
            "compute them once per step over all tokens of the step (every micro-batch)"
        )
    return torch.where(mask, counts[pos], torch.zeros_like(ids))


def _inverse_or_zero(counts: torch.Tensor, scale: int) -> torch.Tensor:
    """1 / (scale * counts) where counts > 0, else 0, in float64."""
    denom = counts.to(torch.float64) * scale
    return torch.where(denom > 0, 1.0 / denom.clamp(min=1.0), torch.zeros_like(denom))


def _token_weights(
    norm: LossNormalizers, mask: Tensor, sample_ids: Tensor, prompt_ids: Tensor
) -> Tensor:
    counts = mask.to(torch.int64) * norm.num_tokens
    return _inverse_or_zero(counts, 1)


def _sample_weights(
    norm: LossNormalizers, mask: Tensor, sample_ids: Tensor, prompt_ids: Tensor
) -> Tensor:
    return _inverse_or_zero(norm.sample_token_counts(sample_ids, mask), norm.num_samples)


def _prompt_weights(
    norm: LossNormalizers, mask: Tensor, sample_ids: Tensor, prompt_ids: Tensor
) -> Tensor:
    return _inverse_or_zero(norm.prompt_token_counts(prompt_ids, mask), norm.num_prompts)


AggregationFn = Callable[[LossNormalizers, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# loss aggregation by name (recipes select with `aggregation: <name>`)
AGGREGATIONS: dict[str, AggregationFn] = {
    "prompt": _prompt_weights,
    "sample": _sample_weights,
    "token": _token_weights,
}
assert tuple(AGGREGATIONS) == AGGREGATION_NAMES


def check_token_inputs(loss_mask: torch.Tensor, **ids: torch.Tensor) -> None:
    """Raise ValueError unless ``loss_mask`` is a 1-D bool ``[T]`` and every id a long ``[T]``."""
    if loss_mask.dim() != 1 or loss_mask.dtype != torch.bool:
        raise ValueError(
            f"loss_mask must be a 1-D bool tensor [T], got {loss_mask.dtype} "
            f"{tuple(loss_mask.shape)}"
        )
    for name, value in ids.items():
        if value.shape != loss_mask.shape:
            raise ValueError(
                f"{name} must have the shape of loss_mask {tuple(loss_mask.shape)}, got "
                f"{tuple(value.shape)}"
            )
        if value.dtype != torch.int64:
            raise ValueError(f"{name} must be a long (int64) tensor, got {value.dtype}")


def _local_counts(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keys, counts = torch.unique(ids[mask], sorted=True, return_counts=True)
    return keys, counts.to(torch.int64)


def _merge_over_group(
    keys: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``counts`` by key over the ranks of ``group``; keys may differ between ranks."""
    from megatron_rl.platform import collectives

    size = torch.tensor([keys.numel()], dtype=torch.int64, device=keys.device)
    width = int(collectives.all_reduce(size, op=dist.ReduceOp.MAX, group=group).item())
    # One gather of [2, width]: row 0 keys, row 1 counts; padding has count 0 and is dropped.
    local = torch.zeros(2, width, dtype=torch.int64, device=keys.device)
    local[0, : keys.numel()] = keys
    local[1, : keys.numel()] = counts
    table = torch.cat(collectives.all_gather(local, group=group), dim=1)
    table = table[:, table[1] > 0]
    merged_keys, inverse = torch.unique(table[0], sorted=True, return_inverse=True)
    merged = torch.zeros(merged_keys.numel(), dtype=torch.int64, device=keys.device)
    merged.index_add_(0, inverse, table[1])
    return merged_keys, merged


def compute_loss_normalizers(
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    prompt_ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> LossNormalizers:
    """Count masked tokens per sample, per prompt and in total over the global batch.

    Call once per optimizer step on each data-parallel rank with all of that rank's tokens
    (all its micro-batches concatenated); with ``group`` (the data-parallel group) the counts
    of all ranks are merged, so every rank gets the same global normalisers. Without
    ``group`` the given tokens are the whole batch.

    Args:
        loss_mask: ``[T]`` bool, tokens that carry loss.
        sample_ids: ``[T]`` long, globally unique id of each token's sample.
        prompt_ids: ``[T]`` long, globally unique id of each token's prompt.
        group: data-parallel process group, or None for a single process.
    """
    check_token_inputs(loss_mask, sample_ids=sample_ids, prompt_ids=prompt_ids)
    sample_keys, sample_tokens = _local_counts(sample_ids, loss_mask)
    prompt_keys, prompt_tokens = _local_counts(prompt_ids, loss_mask)
    if group is not None and dist.get_world_size(group) > 1:
        sample_keys, sample_tokens = _merge_over_group(sample_keys, sample_tokens, group)
        prompt_keys, prompt_tokens = _merge_over_group(prompt_keys, prompt_tokens, group)
    return LossNormalizers(
        sample_keys=sample_keys,
        sample_tokens=sample_tokens,
        prompt_keys=prompt_keys,
        prompt_tokens=prompt_tokens,
        num_tokens=int(sample_tokens.sum().item()),
    )

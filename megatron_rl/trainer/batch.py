"""Samples -> padded micro-batches of token ids with per-token RL tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch


@dataclass
class TrainSample:
    """One generated sample as the trainer sees it.

    ``gen_logprobs``, ``policy_mask`` and ``versions`` are per response token;
    ``policy_mask`` is False on tokens the policy did not generate (interruption text).
    ``group`` numbers the sample's prompt within the step (unique per step).
    """

    prompt_id: int
    group: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    gen_logprobs: list[float]
    policy_mask: list[bool]
    reward: float
    versions: list[int]
    truncated: bool = False
    interrupted: bool = False


@dataclass
class MicroBatch:
    """Right-padded sequences and the flattened response-token tensors (T tokens).

    ``select``: ``[b, s-1]`` bool, the positions of ``token_logprobs(model, tokens)`` that
    predict a response token, in the order of the flat tensors below.
    """

    tokens: torch.Tensor  # [b, s]
    select: torch.Tensor  # [b, s-1]
    gen_logprobs: torch.Tensor  # [T]
    advantages: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T] bool
    sample_ids: torch.Tensor  # [T]
    prompt_ids: torch.Tensor  # [T]

    def to(self, device) -> MicroBatch:
        return MicroBatch(*(getattr(self, f.name).to(device) for f in fields(self)))


def right_padded(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens [b, s]``: the rows ``prompt + response``, right-padded; ``select [b, s-1]``:
    the positions of ``token_logprobs(model, tokens)`` that predict a response token."""
    length = max(len(p) + len(r) for p, r in pairs)
    tokens = torch.full((len(pairs), length), pad_id, dtype=torch.long)
    select = torch.zeros((len(pairs), length - 1), dtype=torch.bool)
    for row, (prompt, response) in enumerate(pairs):
        seq = list(prompt) + list(response)
        tokens[row, : len(seq)] = torch.tensor(seq)
        select[row, len(prompt) - 1 : len(seq) - 1] = True
    return tokens, select


def flat_response_tensors(
    samples: Sequence[TrainSample],
    advantages: torch.Tensor,
    keep: torch.Tensor,
    ids: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token tensors of the response tokens of ``samples`` (sample i has id ``ids[i]``,
    default i: ids must be unique over the step's whole batch, all ranks included)."""
    ids = list(range(len(samples))) if ids is None else list(ids)
    cols: dict[str, list] = {k: [] for k in ("gen", "adv", "mask", "sid", "pid")}
    for i, s in enumerate(samples):
        n = len(s.response_tokens)
        cols["gen"].append(torch.tensor(s.gen_logprobs, dtype=torch.float32))
        cols["adv"].append(torch.full((n,), float(advantages[i])))
        cols["mask"].append(torch.tensor(s.policy_mask, dtype=torch.bool) & bool(keep[i]))
        cols["sid"].append(torch.full((n,), ids[i], dtype=torch.long))
        cols["pid"].append(torch.full((n,), s.group, dtype=torch.long))
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in cols.items()}


def make_micro_batches(
    samples: Sequence[TrainSample],
    advantages: torch.Tensor,
    keep: torch.Tensor,
    micro_batch_size: int,
    pad_id: int = 0,
    ids: Sequence[int] | None = None,
) -> list[MicroBatch]:
    """Split samples (in order) into micro-batches of ``micro_batch_size`` sequences."""
    ids = list(range(len(samples))) if ids is None else list(ids)
    batches = []
    for start in range(0, len(samples), micro_batch_size):
        chunk = samples[start : start + micro_batch_size]
        tokens, select = right_padded([(s.prompt_tokens, s.response_tokens) for s in chunk], pad_id)
        part = slice(start, start + micro_batch_size)
        flat = flat_response_tensors(chunk, advantages[part], keep[part], ids[part])
        batches.append(
            MicroBatch(
                tokens, select, flat["gen"], flat["adv"], flat["mask"], flat["sid"], flat["pid"]
            )
        )
    return batches

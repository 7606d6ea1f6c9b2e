"""Supervised warm start: a short SFT phase so a tiny random model has some skill before RL.

The embedded default starts from a random tiny model; a few hundred steps of next-token
training on the task's worked solutions give it a non-trivial pass rate (deterministic for a
seed), from which RL then visibly improves. Production runs start from an SFT'd checkpoint
and set ``warm_start.steps: 0``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import torch
from tqdm import tqdm

from megatron_rl.models.logprobs import token_logprobs

logger = logging.getLogger(__name__)


def sft_loss(
    model, examples: Sequence[tuple[list[int], list[int]]], pad_id: int = 0
) -> torch.Tensor:
    """Mean negative log-likelihood of the target tokens of ``(prompt, target)`` pairs."""
    length = max(len(p) + len(t) for p, t in examples)
    tokens = torch.full((len(examples), length), pad_id, dtype=torch.long)
    select = torch.zeros((len(examples), length - 1), dtype=torch.bool)
    for row, (prompt, target) in enumerate(examples):
        seq = prompt + target
        tokens[row, : len(seq)] = torch.tensor(seq)
        select[row, len(prompt) - 1 : len(seq) - 1] = True
    return -token_logprobs(model, tokens)[select].mean()


def supervised_warm_start(
    model,
    examples: Sequence[tuple[list[int], list[int]]],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    pad_id: int = 0,
) -> list[float]:
    """Train ``model`` on ``(prompt_tokens, target_tokens)`` pairs; returns the loss per step."""
    if steps <= 0 or not examples:
        return []
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    bar = tqdm(range(steps), desc="warm start (SFT)", leave=False)
    for _ in bar:
        batch = rng.sample(list(examples), min(batch_size, len(examples)))
        loss = sft_loss(model, batch, pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    logger.info("warm start: %d steps, loss %.3f -> %.3f", steps, losses[0], losses[-1])
    return losses

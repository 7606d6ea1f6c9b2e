"""Supervised warm start: a short SFT phase so a tiny random model has some skill before RL.

The embedded default starts from a random tiny model; a few hundred steps of next-token
training on the task's worked solutions give it a non-trivial pass rate (deterministic for a
seed), from which RL then visibly improves. Production runs start from an SFT'd checkpoint
and set ``warm_start.steps: 0``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.config.sections import OptimizerConfig
from megatron_rl.models.logprobs import logits_to_logprobs
from megatron_rl.trainer import console
from megatron_rl.trainer.batch import right_padded

logger = logging.getLogger(__name__)


@dataclass
class SFTBatch:
    """Right-padded ``(prompt + target)`` rows; ``select [b, s-1]`` marks target positions."""

    tokens: torch.Tensor  # [b, s]
    select: torch.Tensor  # [b, s-1]

    def to(self, device) -> SFTBatch:
        return SFTBatch(self.tokens.to(device), self.select.to(device))


def sft_batch(examples: Sequence[tuple[list[int], list[int]]], pad_id: int = 0) -> SFTBatch:
    return SFTBatch(*right_padded(examples, pad_id))


def supervised_warm_start(
    model,
    examples: Sequence[tuple[list[int], list[int]]],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    pad_id: int = 0,
    before_step: Callable[[], None] | None = None,
) -> list[float]:
    """Train the DDP-wrapped ``model`` on ``(prompt_tokens, target_tokens)`` pairs with a
    megatron AdamW of its own (no weight decay, clip 1.0); returns the mean target-token NLL
    of each step's batch. Data-parallel ranks split each batch; every rank draws the same one.
    ``before_step``: called on every rank before each step (the trainer's preemption check:
    it raises to stop the warm start).
    """
    from megatron.core import parallel_state

    from megatron_rl.trainer.optim import build_optimizer
    from megatron_rl.trainer.step import forward_backward

    if steps <= 0 or not examples:
        return []
    rng = random.Random(seed)
    opt = build_optimizer(
        model, OptimizerConfig(lr=lr, warmup_steps=0, eps=1e-8, weight_decay=0.0)
    ).optimizer
    dp = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    losses = []
    logger.info("warm start: %d steps on %d examples", steps, len(examples))
    main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    bar = console.bar(range(steps), desc="warm start (SFT)", main=main)
    for _ in bar:
        if before_step is not None:
            before_step()
        batch = rng.sample(list(examples), min(batch_size, len(examples)))
        total = sum(len(target) for _, target in batch)
        mine = batch[dp_rank::dp]

        def loss_fn(mb, logits, total=total):
            nll = -logits_to_logprobs(logits, mb.tokens)[mb.select].sum()
            return nll / total, (nll.detach() / total).reshape(1), torch.zeros(0)

        sums, _ = forward_backward(
            model, opt, [sft_batch(mine, pad_id)] if mine else [], loss_fn, 1
        )
        opt.step()
        losses.append(float(sums[0]))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    logger.info("warm start: %d steps, loss %.3f -> %.3f", steps, losses[0], losses[-1])
    return losses


def fitting_examples(
    examples: Sequence[tuple[list[int], list[int]]], max_tokens: int | None
) -> list[tuple[list[int], list[int]]]:
    """The examples whose prompt + target fit ``max_tokens`` (None: all); the others are
    dropped with a warning. One over-long worked solution padded a whole SFT batch to its
    length (a 20,000-token row: tens of GB of attention scores at batch 32)."""
    examples = list(examples)
    if max_tokens is None:
        return examples
    kept = [e for e in examples if len(e[0]) + len(e[1]) <= max_tokens]
    if len(kept) < len(examples):
        logger.warning(
            "warm start: dropped %d of %d examples longer than the model's %d positions",
            len(examples) - len(kept),
            len(examples),
            max_tokens,
        )
    return kept


def warm_start_examples(
    data: Any, tokenizer: Any, template_kwargs: dict[str, Any] | None = None
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of the training prompts of ``data`` (``PromptData``) that
    have a worked solution: the prompt tokenized as the rollouts' prompts are
    (``data.rendering.prompt_token_ids``: one BOS, the chat template's own), the target
    without special tokens and ended with the tokenizer's EOS."""
    from megatron_rl.data import prompt_token_ids, sft_example

    examples = []
    for prompt in data.train():
        if prompt.solution:
            config = data.config_of(prompt.prompt_id)
            text, target = sft_example(
                prompt.problem, prompt.solution, config, tokenizer, template_kwargs
            )
            target_ids = tokenizer(target, add_special_tokens=False)["input_ids"]
            examples.append(
                (prompt_token_ids(text, config, tokenizer), target_ids + [tokenizer.eos_token_id])
            )
    return examples

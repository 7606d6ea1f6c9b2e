"""The validation pass: mean@G pass rate of the current weights on the held-out split.

:func:`validate` generates on the main rank (``on_every_rank``: the other ranks wait for it,
and take part when restarted engines wait for the weights), scores, and logs the record
(:func:`_log_validation`); a ``RewardFailure`` of its scoring is handed to every rank.
:class:`OwedValidation` is the step whose validation a stop on a signal put off, kept by the
checkpoint and done first by the resumed run. A signal that comes during the pass stops it
(:class:`ValidationStopped` on every rank): a pass can outlast the signal's window, and the
checkpoint must come first; its requests are cancelled in the engines, and it is owed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from megatron_rl.rewards.pool import (
    RewardFailure,
    check_error_fraction,
    count_errors,
    count_timeouts,
)
from megatron_rl.rollout.client import GenerationStopped
from megatron_rl.scaling.forecast import resolve_budget
from megatron_rl.trainer import console
from megatron_rl.trainer.compute import generation_share
from megatron_rl.trainer.handoff import RankZeroWaits, on_every_rank
from megatron_rl.trainer.scoring import by_domain, model_text

if TYPE_CHECKING:
    from megatron_rl.rollout import GeneratorPool
    from megatron_rl.trainer.live_forecast import LiveForecast
    from megatron_rl.trainer.setup import Run

logger = logging.getLogger(__name__)


class ValidationStopped(Exception):
    """The validation pass was given up on a stop (:func:`validate`'s ``stopped``), on every
    rank: its requests were cancelled, nothing was logged."""


class OwedValidation:
    """The step whose validation a stop on a signal put off (the checkpoint came first: a
    validation can outlast the signal's window): the resumed run validates it before its
    first step. None: none is owed (a checkpoint without this entry owes none)."""

    def __init__(self) -> None:
        self.step: int | None = None

    def state_dict(self) -> int | None:
        return self.step

    def load_state_dict(self, step: int | None) -> None:
        self.step = step


def sampling_seed(seed: int, prompt_id: int, step: int) -> int:
    """Sampling seed of a prompt submitted at ``step``: the same in a resumed run."""
    return (seed * 1_000_003 + prompt_id * 10_007 + step * 101 + 17) % (2**62)


def validate(
    run: Run,
    pool: GeneratorPool | None,
    step: int,
    main: bool = True,
    waits: RankZeroWaits | None = None,
    forecast: LiveForecast | None = None,
    stopped: Callable[[], bool] | None = None,
) -> float:
    """mean@G pass rate on the held-out split with the current weights; logged overall
    (``val_pass_rate``) and, for a mixture of sources, per domain
    (``val_pass_rate/<domain>``). Every rank calls it: the main rank generates and scores;
    the others take part when restarted engines wait for the weights (``on_every_rank``:
    a death with every engine down mid-validation), and return NaN. ``waits``: the other
    ranks' bound (None: the world's); ``forecast``: the live forecast to update.
    ``stopped``: asked by the main rank while it generates; once true the pass is given up
    (its requests cancelled in the engines, no record) and every rank raises
    :class:`ValidationStopped`."""
    wait = waits.validation if waits is not None else None
    if not main:  # waits for the whole pass, scoring included
        failed = on_every_rank(run, pool, False, lambda: None, wait, share=False)
        if isinstance(failed, Exception):  # the main rank's reward failed, or a stop
            raise failed
        return float("nan")
    cfg = run.config.validation
    # ``num_prompts`` counts per domain, so a cap never leaves a domain out.
    ids = [i for ids in run.data.val_by_domain().values() for i in ids[: cfg.num_prompts]]
    t0 = time.perf_counter()
    hours = run.clock.summary()  # the policy being measured cost this much

    def generate() -> list:  # asked again after a reweigh: the same seeds, the same samples
        if not ids:
            return []
        episodes = (
            {"problems": [run.data.get(i) for i in ids]} if run.config.rollout.episodes else {}
        )
        stop = {"stop_when": stopped} if stopped is not None else {}
        return pool.generate(
            [run.encode(i) for i in ids],
            **stop,
            seeds=[sampling_seed(run.config.seed, -1 - i, step) for i in ids],
            samples_per_prompt=cfg.samples_per_prompt,
            temperature=cfg.temperature,
            **episodes,
        )

    # Blocking validation, accounted apart; the training requests that PipelineRL generators
    # keep decoding meanwhile are training compute (their token share of the window).
    def score() -> tuple | RewardFailure | ValidationStopped | None:
        try:  # scoring too: the other ranks wait until the pass is done
            samples = generate()
        except GenerationStopped as err:  # every rank raises it (on_every_rank)
            return ValidationStopped(f"the validation of step {step} was stopped: {err}")
        if not samples:
            return None
        if stopped is not None and stopped():  # generated; the scoring may be long too
            return ValidationStopped(f"the validation of step {step} was stopped")
        texts = [model_text(run.tokenizer, s) for s in samples]  # a tool's output left out
        refs = [run.data.get(ids[s.prompt_index - samples[0].prompt_index]) for s in samples]
        kinds = [p.kind for p in refs]
        try:  # a failed reward is handed to every rank (on_every_rank), which all raise it
            rewards = run.rewards.score_batch(texts, [p.reference for p in refs], kinds)
            statuses = list(run.rewards.last_statuses)
            limit = run.config.reward.max_error_fraction
            check_error_fraction(statuses, limit, f"the validation pass of step {step}")
        except RewardFailure as err:
            return err
        return samples, kinds, rewards, statuses, sum(run.rewards.last_crashes)

    # The whole pass is in the window, its record and the forecast's hand-off too.
    with run.clock.window("validation") as window:
        tokens_before = pool.generated_tokens()
        logger.info(
            "step %d: validating (%d prompts x %d samples)", step, len(ids), cfg.samples_per_prompt
        )
        with console.phase(f"validation at step {step} ({len(ids)} prompts)"):
            scored = on_every_rank(run, pool, True, score, wait, share=False)
        if scored is None:
            return float("nan")
        if isinstance(scored, (RewardFailure, ValidationStopped)):
            raise scored
        samples, kinds, rewards, statuses, crashes = scored
        val_tokens = sum(len(s) for s in samples)
        train_tokens = pool.generated_tokens() - tokens_before - val_tokens
        window.train_fraction = generation_share(train_tokens, val_tokens)
        return _log_validation(
            run, step, hours, t0, window.train_fraction, kinds, rewards, statuses, crashes, forecast
        )


def _log_validation(
    run: Run,
    step: int,
    hours: dict[str, float],
    t0: float,
    train_fraction: float,
    kinds: list[str],
    rewards: list[float],
    statuses: list[str],
    crashes: int,
    forecast: LiveForecast | None,
) -> float:
    """The validation's record (at the compute ``hours`` of the policy measured), its log
    line and the forecast's job; returns the pass rate."""
    rate = sum(r > 0 for r in rewards) / len(rewards)
    if run.exporter is not None:
        run.exporter.val_pass_rate = rate  # for the README of the next export
    # A mixture (math + code) also logs each domain's pass rate: one curve per domain.
    mixture = len(run.data.sources) > 1
    per_domain = by_domain("val_pass_rate", kinds, rewards, mean=False) if mixture else {}
    run.metrics.log(
        {
            "step": step,
            **hours,
            "val_pass_rate": rate,
            **per_domain,
            "val_samples": len(rewards),
            **{f"val_reward_{k}": v for k, v in count_timeouts(statuses).items()},
            "val_reward_errors": count_errors(statuses),
            "val_reward_crashes": crashes,
            "val_train_fraction": train_fraction,
            "val_seconds": time.perf_counter() - t0,
        }
    )
    domains = "".join(f"{k.split('/')[1]} {v:.3f}, " for k, v in per_domain.items())
    logger.info(
        "step %d: validation pass rate %.3f (%s%d samples)",
        step,
        rate,
        domains,
        len(rewards),
        extra=console.QUIET_KEEPS,  # --quiet shows it
    )
    if forecast is not None:
        training = run.config.training
        budget = resolve_budget(
            run.config.forecast,
            training.max_gpu_hours,
            training.max_steps,
            step,
            hours["gpu_hours"],
        )
        forecast.submit(step, budget, hours["gpu_hours"])
    return rate

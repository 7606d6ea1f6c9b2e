"""The post-push log-prob probe: is the generator still running the trainer's weights?

The per-step gap monitor (``policy_update``) compares log-probs only on samples generated
entirely by the trainer's current weights. In PipelineRL every batch after the first was
generated, at least in part, before the latest push, so the monitor measures nothing from
step 2 on and a weight path that breaks later would go unseen. The probe closes that gap:
right after a push (every ``training.logprob_probe_every`` steps) the main rank generates a
few short samples with the new weights, every rank scores them with the trainer's forward
(a collective: TP / PP / EP / DP ranks all take part), and the mean gap goes through the
same limit, raising :class:`~megatron_rl.trainer.step.LogprobGapError`.

Probe samples are never trained on and never scored: they come from ``pool.generate`` (which
takes only its own requests' samples), their prompts are fixed ids, not drawn from the
sampler, and they feed no pass-rate history. Only samples whose every token was generated at
the probed version count; any other one (a push during the probe) is discarded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.models.logprobs import logits_to_logprobs
from megatron_rl.platform import collectives
from megatron_rl.trainer.batch import TrainSample, is_on_policy, make_micro_batches
from megatron_rl.trainer.step import GAP_CAUSES, LogprobGapError, forward_backward


@dataclass(frozen=True)
class ProbeResult:
    """One probe: the mean |trainer - generator| log-prob over ``tokens`` policy tokens of
    samples generated at policy ``version`` (the same on every rank)."""

    version: int
    gap: float
    tokens: int
    max_gap: float
    samples: int  # samples measured
    discarded: int  # samples dropped for tokens of another version
    seconds: float

    def metrics(self) -> dict[str, float | int]:
        return {
            "logprob_probe_gap": self.gap,
            "logprob_probe_tokens": self.tokens,
            "logprob_probe_max_gap": self.max_gap,
            "logprob_probe_seconds": self.seconds,
        }


class LogprobProbe:
    """Schedules, generates and measures the probes of one run (see the module docstring).

    ``prompt_ids``: the ids the probe's prompts are taken from in turn; ``encode``: id ->
    prompt token ids; ``every``: 0 disables the probe; ``limit``: the gap limit (None: log
    only), the recipe key ``limit_key`` (FP8 rollouts: ``training.max_logprob_gap_fp8``).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        encode: Callable[[int], list[int]],
        every: int,
        samples: int,
        max_tokens: int,
        temperature: float,
        limit: float | None,
        seed: int = 0,
        start_step: int = 0,
        token_multiple: int = 1,
        limit_key: str = "training.max_logprob_gap",
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.encode = encode
        self.every = every if self.prompt_ids else 0
        self.samples = samples
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.limit = limit
        self.limit_key = limit_key
        self.seed = seed
        self.token_multiple = token_multiple
        self._last_push = start_step  # the step of the last push seen (resume: its step)

    @classmethod
    def from_run(cls, run, start_step: int, token_multiple: int) -> LogprobProbe:
        config = run.config
        training = config.training
        return cls(
            run.data.val_ids or run.data.train_ids,
            run.encode,
            training.logprob_probe_every,
            training.logprob_probe_samples,
            training.logprob_probe_max_tokens,
            config.rollout.temperature,
            training.logprob_gap_limit(config.model.dtype, config.rollout.quantization),
            seed=config.seed,
            start_step=start_step,
            token_multiple=token_multiple,
            limit_key=training.logprob_gap_key(config.rollout.quantization),
        )

    def due(self, step: int, pushed: bool) -> bool:
        """Whether the push that ended ``step`` is probed: the first push in each window of
        ``every`` steps (every step's push in PipelineRL; PPO-off-policy-k pushes every k)."""
        if not pushed or not self.every:
            return False
        due = step // self.every > self._last_push // self.every
        self._last_push = step
        return due

    def after_push(
        self,
        model,
        pool,
        step: int,
        pushed: bool,
        share: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> ProbeResult | None:
        """Probe the push that ended ``step`` if due. Every rank calls this (``pool``: None
        off the main rank); returns the same result on every rank, or None. ``share(make)``:
        ``make()`` on the main rank, broadcast to every rank (default: a plain broadcast;
        the loop's also re-sends weights to restarted engines when they wait for them)."""
        if not self.due(step, pushed):
            return None
        start = time.perf_counter()
        if share is None:
            share = lambda make: collectives.broadcast_object(make())  # noqa: E731
        version, samples, discarded = share(
            lambda: self.generate(pool, step) if pool is not None else None
        )
        gap, tokens, max_gap = measure_gap(
            model, samples, version, self.temperature, self.token_multiple
        )
        seconds = time.perf_counter() - start
        return ProbeResult(version, gap, tokens, max_gap, len(samples), discarded, seconds)

    def generate(self, pool, step: int) -> tuple[int, list[TrainSample], int]:
        """(version, samples generated entirely at it, samples discarded): main rank only.

        Submitted after the push, so they start at the current version; blocking, so no
        push can come in between here (one that did would leave mixed versions: dropped).
        """
        version = pool.version
        ids = self._prompts(step)
        seeds = [(self.seed * 1_000_003 + step * 7_919 + i * 131 + 5) % 2**62 for i in ids]
        out = pool.generate(
            [self.encode(i) for i in ids],
            samples_per_prompt=1,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seeds=seeds,
        )
        samples = [
            TrainSample(
                prompt_id=ids[k],
                group=k,
                prompt_tokens=list(s.prompt_ids),
                response_tokens=list(s.response_ids),
                gen_logprobs=list(s.logprobs),
                policy_mask=list(s.mask),
                reward=0.0,
                versions=list(s.versions),
                routed_experts=s.routed_experts,  # replayed as in training (routing replay)
            )
            for k, s in enumerate(out)
        ]
        kept = [s for s in samples if is_on_policy(s, version)]
        return version, kept, len(samples) - len(kept)

    def check(self, result: ProbeResult | None) -> None:
        """Raise :class:`LogprobGapError` when the probe's gap exceeds the limit (the result
        is global: every rank raises, or none does)."""
        if result is None or self.limit is None or not result.tokens:
            return
        if result.gap > self.limit:
            raise LogprobGapError(
                f"trainer vs generator log-prob gap {result.gap:.3g} (mean over "
                f"{result.tokens} tokens of {result.samples} probe samples generated right "
                f"after the push of policy version {result.version}; max {result.max_gap:.3g}) "
                f"exceeds {self.limit_key} {self.limit:g}: the generator no longer "
                "runs the trainer's weights; the run stops before training on samples of that version. "
                + GAP_CAUSES
            )

    def _prompts(self, step: int) -> list[int]:
        """This probe's prompt ids: the next ``samples`` of the list, in turn."""
        start = (step // max(self.every, 1)) * self.samples
        n = len(self.prompt_ids)
        return [self.prompt_ids[(start + j) % n] for j in range(min(self.samples, n))]


def measure_gap(
    model,
    samples: Sequence[TrainSample],
    version: int,
    temperature: float = 1.0,
    token_multiple: int = 1,
) -> tuple[float, int, float]:
    """(mean, token count, max) of |trainer - generator| log-probs over the policy tokens of
    ``samples`` generated entirely by ``version`` (the trainer's current weights).

    A forward-only pass of ``model`` (the DDP-wrapped policy) on every rank, the same
    ``samples`` everywhere: data-parallel ranks split them, pipeline stages run megatron's
    schedule; the result is global. No gradient is touched.
    """
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    size, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    mine = [i for i in range(len(samples)) if i % size == rank]
    zeros, keep = torch.zeros(len(mine)), torch.ones(len(mine), dtype=torch.bool)
    batches = make_micro_batches(
        [samples[i] for i in mine],
        zeros,
        keep,
        max(len(mine), 1),
        ids=mine,
        monitor_version=version,
        multiple=token_multiple,
    )

    def loss_fn(mb, logits):
        logprobs = logits_to_logprobs(logits, mb.tokens, temperature)[mb.select]
        gap = (logprobs.float() - mb.gen_logprobs)[mb.monitor_mask].abs()
        count = torch.tensor(float(gap.numel()), device=gap.device)
        worst = gap.max() if gap.numel() else torch.zeros((), device=gap.device)
        return 0.0 * logprobs.sum(), torch.stack([gap.sum(), count]), worst.reshape(1)

    with torch.no_grad():
        sums, maxes = forward_backward(
            model,
            None,
            batches,
            loss_fn,
            num_sums=2,
            num_maxes=1,
            token_multiple=token_multiple,
            forward_only=True,
        )
    tokens = int(sums[1])
    gap = float(sums[0]) / tokens if tokens else float("nan")
    return gap, tokens, float(maxes[0])

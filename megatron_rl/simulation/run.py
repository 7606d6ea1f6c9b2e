"""The trainer emulator: the training loop's schedule (``trainer/loop.py``) on a simulated clock.

Each step, as ``train()`` does: ask the real ``RolloutSource`` for the next batch at the pool's
version (its waits move the clock), update (the clock moves by ``CostModel.train_step`` while
the engines keep generating and the source's feeder tops them up), then push the weights when
the source wants it (the engines pause for ``CostModel.push``). Only the engines, the trainer
and the clock are emulated.

Utilisation is measured after ``warmup`` steps (the pipeline filling), over ``steps`` steps.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field

from megatron_rl.simulation.costs import CostModel
from megatron_rl.simulation.engines import EmulatedPool
from megatron_rl.simulation.workload import LengthModel
from megatron_rl.trainer.rollout_source import RolloutSource

# The simulated feeder's poll interval: the real one polls every 20 ms
# (rollout_source.FEED_SECONDS); sequences here decode for seconds to minutes, and a coarser
# step keeps a simulated run of thousands of updates fast.
FEED_INTERVAL = 1.0

DP_ASSIGNMENTS = ("ideal", "modulo", "balanced")


def dp_imbalance(group_tokens: list[int], kept: list[bool], dp: int, assignment: str) -> float:
    """Busiest data-parallel rank's tokens over the mean (>= 1) when the groups of
    ``group_tokens`` (tokens per group, batch order) reach ``dp`` ranks by ``assignment``
    (``SimSettings.dp_assignment``) and only those ``kept`` are trained on."""
    total = sum(t for t, k in zip(group_tokens, kept) if k)
    if assignment == "ideal" or dp == 1 or total == 0:
        return 1.0
    loads = [0] * dp
    if assignment == "modulo":
        for i, (tokens, k) in enumerate(zip(group_tokens, kept)):
            if k:
                loads[i % dp] += tokens
    else:  # balanced: longest group first onto the least-loaded rank
        for tokens in sorted((t for t, k in zip(group_tokens, kept) if k), reverse=True):
            loads[loads.index(min(loads))] += tokens
    return max(loads) / (total / dp)


@dataclass(frozen=True)
class SimSettings:
    """One simulated run: the off-policy mode and k, the batch, the cluster."""

    mode: str  # "pipeline_rl" or "ppo"
    k: int
    prompts_per_step: int
    samples_per_prompt: int
    engines: int
    max_num_seqs: int
    generator_gpus: int
    trainer_gpus: int
    steps: int = 40
    warmup: int = 5
    seed: int = 0
    fill: float = 1.0  # off_policy.pool_fill
    # The fraction of groups with reward variance (the step records' effective_batch_fraction):
    # the update skips the others, so a step costs this fraction of a whole batch's update
    # (in expectation over which groups they are). 1.0: every group is trained on.
    trained_fraction: float = 1.0
    # How kept groups reach the trainer's ``dp`` data-parallel ranks (the step lasts as long as
    # the busiest rank): "ideal" (every rank the mean: the physical limit), "modulo" (group
    # index % dp before zero-variance filtering: trainer/step.py today), "balanced" (greedy
    # longest-first by tokens after filtering: issue 31 item 3). Groups are kept with
    # probability ``trained_fraction``, seeded by the step.
    dp: int = 1
    dp_assignment: str = "ideal"

    def __post_init__(self) -> None:
        if not 0 < self.trained_fraction <= 1:
            raise ValueError(f"trained_fraction must be in (0, 1], got {self.trained_fraction}")
        if self.dp_assignment not in DP_ASSIGNMENTS:
            raise ValueError(
                f"dp_assignment must be one of {', '.join(DP_ASSIGNMENTS)}, "
                f"got {self.dp_assignment!r}"
            )
        if self.dp < 1:
            raise ValueError(f"dp must be >= 1, got {self.dp}")


@dataclass
class SimResult:
    """What a simulated run measured (over the steps after the warmup)."""

    settings: SimSettings
    seconds: float  # simulated wall time of the measured steps
    steps: int
    samples: int
    generator_busy: float  # fraction of engine time decoding or prefilling
    generator_occupancy: float  # running sequences / max_num_seqs, time-averaged
    trainer_busy: float  # fraction of wall time in updates
    push_fraction: float  # fraction of wall time in weight pushes
    lag_tokens: dict[int, int] = field(default_factory=dict)  # per-token lag -> tokens
    max_lag: int = 0
    trained_prompts: list[int] = field(default_factory=list)  # every step's, warmup included
    submitted_prompts: list[int] = field(default_factory=list)
    in_flight_prompts: list[int] = field(default_factory=list)
    preemptions: int = 0
    tokens: int = 0  # prompt + response tokens trained on in the measured steps

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.steps

    @property
    def total_gpus(self) -> int:
        return self.settings.generator_gpus + self.settings.trainer_gpus

    @property
    def samples_per_gpu_hour(self) -> float:
        return self.samples / (self.seconds / 3600 * self.total_gpus)

    def gpu_hours(self, steps: int) -> float:
        """Projected GPU-hours of ``steps`` steps (all GPUs, steady state)."""
        return steps * self.seconds_per_step * self.total_gpus / 3600

    def lag_percentile(self, q: float) -> int:
        """The per-token lag below or at which a fraction ``q`` of trained tokens lies."""
        total = sum(self.lag_tokens.values())
        seen = 0
        for lag in sorted(self.lag_tokens):
            seen += self.lag_tokens[lag]
            if seen >= q * total:
                return lag
        return 0


def simulate(costs: CostModel, lengths: LengthModel, settings: SimSettings) -> SimResult:
    """Run the real ``RolloutSource`` against emulated engines and trainer (module docstring)."""
    s = settings
    if s.mode not in ("pipeline_rl", "ppo"):
        raise ValueError(f"mode must be pipeline_rl or ppo, got {s.mode!r}")
    pool = EmulatedPool(costs, lengths, s.engines, s.max_num_seqs, seed=s.seed)
    counter = itertools.count()
    prompt_len = {}
    submitted: list[int] = []

    def draw(n: int) -> list[int]:
        ids = [next(counter) for _ in range(n)]
        submitted.extend(ids)
        return ids

    def encode(prompt_id: int) -> list[int]:
        if prompt_id not in prompt_len:
            rng = random.Random(f"prompt:{s.seed}:{prompt_id}")
            prompt_len[prompt_id] = lengths.prompt_length(rng)
        return [0] * prompt_len[prompt_id]

    source = RolloutSource(
        pool,
        draw,
        encode,
        s.prompts_per_step,
        s.samples_per_prompt,
        s.mode,
        s.k,
        seed_of=lambda prompt_id: s.seed * 1_000_003 + prompt_id,
        shuffle_seed=s.seed,
        capacity=s.engines * s.max_num_seqs,
        fill=s.fill,
        clock=lambda: pool.now,
    )
    trained: list[int] = []
    lag_tokens: dict[int, int] = {}
    max_lag = 0
    train_seconds = 0.0
    start = busy0 = seq0 = push0 = 0.0
    samples = tokens = 0
    version = 0  # the trainer's: updates done (the pool's version after each push)
    for step in range(s.warmup + s.steps):
        if step == s.warmup:
            start = pool.now
            busy0 = sum(e.busy_seconds for e in pool.engines)
            seq0 = sum(e.seq_seconds for e in pool.engines)
            push0 = pool.push_seconds
        groups = source.next_batch(pool.version)
        sequence_lengths = []
        group_tokens = []
        for group in groups:
            trained.append(group.prompt_id)
            group_tokens.append(sum(x.prompt_len + x.tokens for x in group.samples))
            for sample in group.samples:
                sequence_lengths.append(sample.prompt_len + sample.tokens)
                for v, n in sample.segments:
                    lag = version - v
                    max_lag = max(max_lag, lag)
                    if step >= s.warmup:
                        lag_tokens[lag] = lag_tokens.get(lag, 0) + n
        seconds = costs.train_step(sequence_lengths) * s.trained_fraction
        if s.dp_assignment != "ideal":
            rng = random.Random(f"keep:{s.seed}:{step}")
            kept = [rng.random() < s.trained_fraction for _ in groups]
            seconds *= dp_imbalance(group_tokens, kept, s.dp, s.dp_assignment)
        update(pool, source, seconds)  # the engines keep generating, topped up, meanwhile
        version += 1
        if step >= s.warmup:
            train_seconds += seconds
            samples += len(sequence_lengths)
            tokens += sum(sequence_lengths)
        if source.wants_push():
            pool.push_weights((), version=version)
    wall = pool.now - start
    engines = len(pool.engines)
    busy = sum(e.busy_seconds for e in pool.engines) - busy0
    seq = sum(e.seq_seconds for e in pool.engines) - seq0
    return SimResult(
        settings=s,
        seconds=wall,
        steps=s.steps,
        samples=samples,
        generator_busy=busy / (engines * wall),
        generator_occupancy=seq / (engines * s.max_num_seqs * wall),
        trainer_busy=train_seconds / wall,
        push_fraction=(pool.push_seconds - push0) / wall,
        lag_tokens=lag_tokens,
        max_lag=max_lag,
        trained_prompts=trained,
        submitted_prompts=submitted,
        in_flight_prompts=source.in_flight_prompt_ids(),
        preemptions=sum(e.preemptions for e in pool.engines),
        tokens=tokens,
    )


def update(pool: EmulatedPool, source: RolloutSource, seconds: float) -> None:
    """The trainer's update of ``seconds``: the clock moves on while the source's feeder
    (``RolloutSource.feeding`` in ``train()``) collects and tops up every ``FEED_INTERVAL``."""
    end = pool.now + seconds
    while pool.now < end:
        pool.advance(min(FEED_INTERVAL, end - pool.now))
        source.feed()


def settings_from_config(config, mode: str, k: int, **overrides) -> SimSettings:
    """``SimSettings`` of a recipe (``RunConfig``) for ``mode`` and ``k``."""
    rollout, cluster = config.rollout, config.cluster
    fields = dict(
        mode=mode,
        k=k,
        prompts_per_step=config.batch.prompts_per_step,
        samples_per_prompt=config.batch.samples_per_prompt,
        engines=rollout.engines,
        max_num_seqs=rollout.max_num_seqs,
        fill=config.off_policy.pool_fill,
        generator_gpus=cluster.generator_gpus,
        trainer_gpus=cluster.trainer_gpus,
    )
    fields.update(overrides)
    return SimSettings(**fields)

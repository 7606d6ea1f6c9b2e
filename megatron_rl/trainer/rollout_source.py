"""Where the trainer's batches come from: PipelineRL-k or PPO-off-policy-k over the pool.

A *group* is the G samples of one prompt. The source keeps the generator pool busy, hands the
trainer complete groups and enforces the off-policy bound:

* ``pipeline_rl`` (max lag k): generation never stops. Up to two batches of prompts are in
  flight; after every optimizer step the new weights are pushed in flight. A group whose
  oldest token was produced by version ``o`` must be trained on while the policy version is
  at most ``o + k``: when such a group is due, the trainer waits for it (never drops it), and
  due groups are taken first.
* ``ppo`` (k): generate k x B prompts with the current weights, wait for all, then hand out
  k batches of B, cut after a seeded shuffle of the groups (sorting them, by dataset id or
  by completion time, would stratify the minibatches); the pool is idle during the k updates.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_rl.rollout.samples import Sample

logger = logging.getLogger(__name__)


class PromptsExhausted(Exception):
    """Every training prompt is retired (No-Positive-Resampling) and nothing is left to train."""


@dataclass
class Group:
    """The samples of one prompt (complete when ``len(samples) == size``)."""

    prompt_id: int
    size: int
    submitted_version: int
    samples: list[Sample] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.samples) == self.size

    @property
    def oldest_version(self) -> int:
        """Oldest policy version of any token (the submission version bounds unseen ones)."""
        seen = [s.oldest_version for s in self.samples if s.versions]
        if self.complete and seen:
            return min(seen)
        return self.submitted_version


class RolloutSource:
    """Turns prompt ids into complete groups with bounded staleness (see module docstring).

    ``next_prompt_ids(n)``: the sampler; ``encode(prompt_id)``: prompt token ids.
    """

    def __init__(
        self,
        pool,
        next_prompt_ids: Callable[[int], list[int]],
        encode: Callable[[int], list[int]],
        batch_prompts: int,
        samples_per_prompt: int,
        mode: str,
        k: int,
        seed_of: Callable[[int], int] | None = None,
        shuffle_seed: int = 0,
    ) -> None:
        self.pool = pool
        self.next_prompt_ids = next_prompt_ids
        self.encode = encode
        self.batch_prompts = batch_prompts
        self.samples_per_prompt = samples_per_prompt
        self.mode = mode
        self.k = k
        self.seed_of = seed_of  # prompt id -> sampling seed (reproducible generation)
        self.shuffle_seed = shuffle_seed  # PPO-off-policy-k minibatch order
        self._groups: dict[int, Group] = {}  # pool prompt index -> group
        self._ready: list[Group] = []
        self._ppo_queue: list[list[Group]] = []
        self.exhausted = False

    def _draw(self, n: int) -> list[int]:
        if self.exhausted or n <= 0:
            return []
        try:
            return self.next_prompt_ids(n)
        except RuntimeError as err:  # the sampler: every prompt retired
            logger.info("%s: training on what is in flight, then stopping", err)
            self.exhausted = True
            return []

    # -- bookkeeping ------------------------------------------------------------------------
    def in_flight_prompt_ids(self) -> list[int]:
        """Dataset ids of prompts submitted but not yet handed to the trainer (a checkpoint
        records them so that a resumed run regenerates them: nothing skipped, nothing twice)."""
        ids = [g.prompt_id for g in self._groups.values()] + [g.prompt_id for g in self._ready]
        ids += [g.prompt_id for batch in self._ppo_queue for g in batch]
        return ids

    def submit(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            return
        seeds = [self.seed_of(p) for p in prompt_ids] if self.seed_of else None
        indices = self.pool.submit(
            [self.encode(p) for p in prompt_ids], self.samples_per_prompt, seeds=seeds
        )
        for index, prompt_id in zip(indices, prompt_ids):
            self._groups[index] = Group(prompt_id, self.samples_per_prompt, self.pool.version)

    def _collect(self, timeout: float) -> None:
        for sample in self.pool.poll(timeout):
            group = self._groups[sample.prompt_index]
            group.samples.append(sample)
            if group.complete:
                del self._groups[sample.prompt_index]
                self._ready.append(group)

    # -- batches ----------------------------------------------------------------------------
    def next_batch(self, version: int) -> list[Group]:
        """The next batch of complete groups for the trainer at policy ``version``."""
        if self.mode == "ppo":
            return self._next_ppo_batch()
        return self._next_pipeline_batch(version)

    def _next_pipeline_batch(self, version: int) -> list[Group]:
        # Keep two batches of prompts in flight (the next one generates while we train).
        self.submit(self._draw(2 * self.batch_prompts - len(self._groups) - len(self._ready)))
        while True:
            self._collect(timeout=0.0)
            due = [g for g in self._groups.values() if version - g.oldest_version >= self.k]
            enough = len(self._ready) >= self.batch_prompts or (self.exhausted and not self._groups)
            if enough and not due:
                break
            self._collect(timeout=1.0)
        if not self._ready:
            raise PromptsExhausted()
        # Oldest first: groups that would exceed the lag next step are trained on now.
        self._ready.sort(key=lambda g: g.oldest_version)
        must = sum(1 for g in self._ready if version - g.oldest_version >= self.k)
        take = max(self.batch_prompts, must)
        batch, self._ready = self._ready[:take], self._ready[take:]
        return batch

    def _next_ppo_batch(self) -> list[Group]:
        if not self._ppo_queue:
            self.submit(self._draw(self.k * self.batch_prompts))
            while self._groups:
                self._collect(timeout=1.0)
            groups, self._ready = self._ready, []
            groups = shuffled_groups(groups, self.shuffle_seed)
            self._ppo_queue = [
                groups[i : i + self.batch_prompts]
                for i in range(0, len(groups), self.batch_prompts)
            ]
        if not self._ppo_queue:
            raise PromptsExhausted()
        return self._ppo_queue.pop(0)

    def wants_push(self) -> bool:
        """PPO pushes once per k updates (the pool is idle in between); PipelineRL every step."""
        return self.mode != "ppo" or not self._ppo_queue


def shuffled_groups(groups: list[Group], seed: int) -> list[Group]:
    """``groups`` in a seeded random order that depends only on ``seed`` and the set of prompt
    ids: the canonical order (by prompt id) is shuffled by a generator seeded with both, so the
    order is the same whatever order the groups completed in and however many rounds ran before
    a resume, and the k minibatches cut from it are not stratified by dataset id."""
    ordered = sorted(groups, key=lambda g: g.prompt_id)
    key = f"{seed}:" + ",".join(str(g.prompt_id) for g in ordered)
    random.Random(key).shuffle(ordered)  # str seeds hash with sha512: stable across processes
    return ordered

"""PipelineRL-k / PPO-off-policy-k batching against a simulated generator pool."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.samples import Sample
from megatron_rl.trainer.rollout_source import RolloutSource


class SimulatedPool:
    """Requests progress one token per ``poll``; prompt p's samples need ``length(p)`` tokens.
    Tokens carry the version current when they were produced, as in-flight pushes do."""

    def __init__(self, length):
        self.length = length
        self.version = 0
        self._next = 0
        self._live: dict[int, list[Sample]] = {}
        self.submitted: list[int] = []

    def submit(self, prompts, samples_per_prompt, seeds=None):
        out = []
        for prompt in prompts:
            index = self._next
            self._next += 1
            self._live[index] = [Sample(index, j, list(prompt)) for j in range(samples_per_prompt)]
            self.submitted.append(prompt[0])
            out.append(index)
        return out

    def poll(self, timeout=0.0):
        done = []
        for index, samples in list(self._live.items()):
            for s in samples:
                s.append([7], [-1.0], self.version, True)
            if len(samples[0]) >= self.length(samples[0].prompt_ids[0]):
                done.extend(samples)
                del self._live[index]
        return done

    def push(self):
        self.version += 1


def make_source(pool, mode, k, batch=4, group=2):
    counter = iter(range(10**6))
    return RolloutSource(
        pool, lambda n: [next(counter) for _ in range(n)], lambda pid: [pid], batch, group, mode, k
    )


@pytest.mark.parametrize("k", [1, 2, 8])
def test_pipeline_never_exceeds_max_lag_and_never_drops(k):
    # Every 5th prompt is 12x slower: without the bound its samples would be very stale.
    pool = SimulatedPool(lambda pid: 24 if pid % 5 == 0 else 2)
    source = make_source(pool, "pipeline_rl", k)
    trained = []
    for _ in range(40):
        batch = source.next_batch(pool.version)
        assert len(batch) >= 4
        for group in batch:
            assert group.complete
            lag = pool.version - min(s.oldest_version for s in group.samples)
            assert lag <= k
            trained.append(group.prompt_id)
        pool.push()
    assert len(trained) == len(set(trained))  # nothing twice
    in_flight = set(source.in_flight_prompt_ids())
    assert set(pool.submitted) == set(trained) | in_flight  # nothing dropped
    assert any(pid % 5 == 0 for pid in trained)  # slow prompts are trained on, not skipped


def test_pipeline_lag_one_means_waiting_for_stragglers():
    pool = SimulatedPool(lambda pid: 30 if pid == 0 else 1)
    source = make_source(pool, "pipeline_rl", k=1)
    first = source.next_batch(pool.version)
    assert 0 not in [g.prompt_id for g in first]
    pool.push()
    second = source.next_batch(pool.version)  # prompt 0 is due now: the source waits for it
    assert 0 in [g.prompt_id for g in second]


def test_ppo_generates_k_batches_at_one_version():
    pool = SimulatedPool(lambda pid: 3)
    source = make_source(pool, "ppo", k=3)
    batches = []
    for _ in range(3):
        batches.append(source.next_batch(pool.version))
        assert source.wants_push() == (len(batches) == 3)
        pool.push()
    assert [len(b) for b in batches] == [4, 4, 4]
    versions = {s.versions[0] for b in batches for g in b for s in g.samples}
    assert versions == {0}  # all generated before any update
    assert len(pool.submitted) == 12


@pytest.mark.parametrize("mode", ["pipeline_rl", "ppo"])
def test_exhausted_sampler_drains_then_stops(mode):
    from megatron_rl.trainer.rollout_source import PromptsExhausted

    pool = SimulatedPool(lambda pid: 2)
    left = iter(range(6))  # six prompts, then every prompt is retired

    def draw(n):
        out = [p for _, p in zip(range(n), left)]
        if len(out) < n and not out:
            raise RuntimeError("all training prompts are retired (No-Positive-Resampling)")
        return out

    source = RolloutSource(pool, draw, lambda pid: [pid], 4, 2, mode, 1)
    trained = []
    with pytest.raises(PromptsExhausted):
        for _ in range(10):
            trained += [g.prompt_id for g in source.next_batch(pool.version)]
            pool.push()
    assert sorted(trained) == list(range(6))  # everything drawn is trained on, once


def _ppo_minibatches(seed: int, k: int = 4, batch: int = 8) -> list[list[int]]:
    pool = SimulatedPool(lambda pid: 2 + pid % 3)  # groups complete out of id order
    counter = iter(range(10**6))
    source = RolloutSource(
        pool,
        lambda n: [next(counter) for _ in range(n)],
        lambda pid: [pid],
        batch,
        2,
        "ppo",
        k,
        shuffle_seed=seed,
    )
    return [[g.prompt_id for g in source.next_batch(pool.version)] for _ in range(k)]


def test_ppo_minibatches_are_a_seeded_shuffle_not_sorted_by_id():
    first = _ppo_minibatches(seed=1)
    assert first == _ppo_minibatches(seed=1)  # reproducible for a seed
    assert first != _ppo_minibatches(seed=2)  # and the seed matters
    assert sorted(p for mb in first for p in mb) == list(range(32))  # every prompt once
    # Sorted by id, minibatch j would hold ids 8j..8j+7 exactly (stratified); shuffled, each
    # minibatch spans the id range: its ids are not one contiguous block.
    for mb in first:
        assert max(mb) - min(mb) > len(mb) - 1

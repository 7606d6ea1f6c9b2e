"""PipelineRL-k / PPO-off-policy-k batching against a simulated generator pool."""

from __future__ import annotations

import threading

import pytest

from megatron_rl.rollout.client import RolloutClient
from megatron_rl.rollout.samples import Sample
from megatron_rl.trainer.rollout_source import RolloutSource


class SimulatedPool(RolloutClient):  # engines that never restart: the defaults
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


# -- dynamic sampling ---------------------------------------------------------------------------


def flat_rewards(pid: int) -> bool:
    """The fake verifier of the dynamic-sampling tests: prompts 0, 3, 6 ... get rewards that
    are all equal (alternately all correct and all wrong), the others mixed ones."""
    return pid % 3 == 0


class FakeScorer:
    """``DynamicSampling`` callbacks over ``flat_rewards``; records what was scored/dropped."""

    def __init__(self, flat=flat_rewards):
        self.flat = flat
        self.scored: list[int] = []
        self.dropped: list[int] = []

    def score(self, groups):
        for g in groups:
            assert g.complete and g.rewards is None  # each group scored once, when complete
            if self.flat(g.prompt_id):
                g.rewards = [1.0 if g.prompt_id % 2 else -1.0] * g.size
            else:
                g.rewards = [1.0, -1.0] * (g.size // 2)
            self.scored.append(g.prompt_id)

    def discard(self, groups):
        self.dropped += [g.prompt_id for g in groups]


def dynamic_source(pool, mode, k, scorer, max_rounds=8, batch=4, group=2):
    from megatron_rl.trainer.rollout_source import DynamicSampling

    counter = iter(range(10**6))
    dynamic = DynamicSampling(scorer.score, scorer.discard, max_rounds)
    return RolloutSource(
        pool,
        lambda n: [next(counter) for _ in range(n)],
        lambda pid: [pid],
        batch,
        group,
        mode,
        k,
        dynamic=dynamic,
    )


@pytest.mark.parametrize("mode", ["pipeline_rl", "ppo"])
def test_dynamic_sampling_fills_batches_with_groups_that_have_variance(mode):
    pool = SimulatedPool(lambda pid: 2 + pid % 4)  # groups complete out of order
    scorer = FakeScorer()
    source = dynamic_source(pool, mode, k=2, scorer=scorer)
    trained, drawn = [], 0
    for _ in range(12):
        batch = source.next_batch(pool.version)
        counts = source.counts
        assert len(batch) == 4 and not any(flat_rewards(g.prompt_id) for g in batch)
        assert all(g.rewards == [1.0, -1.0] for g in batch)
        assert counts["groups_kept_over_cap"] == 0
        trained += [g.prompt_id for g in batch]
        drawn += counts["prompts_drawn"]
        pool.push()
    # A third of the prompts have zero variance: each was dropped and replaced by a new one,
    # so more prompts were drawn than trained on, and nothing was lost or trained twice.
    assert sorted(scorer.dropped) == [p for p in pool.submitted if flat_rewards(p)
                                      and p not in source.in_flight_prompt_ids()]  # fmt: skip
    assert drawn == len(pool.submitted) > len(trained) + len(source.in_flight_prompt_ids())
    assert len(trained) == len(set(trained)) == 48
    assert set(pool.submitted) == set(trained) | set(scorer.dropped) | set(
        source.in_flight_prompt_ids()
    )
    assert not set(scorer.dropped) & set(source.in_flight_prompt_ids())  # a resume redraws
    # every scored group is either trained, dropped, or still waiting (kept) in the source
    assert len(scorer.scored) == len(set(scorer.scored))
    # without dynamic sampling the same source draws exactly what it trains on
    plain_pool = SimulatedPool(lambda pid: 2 + pid % 4)
    plain, plain_batches = make_source(plain_pool, mode, k=2), []
    for _ in range(2):
        plain_batches.append(plain.next_batch(plain_pool.version))
        plain_pool.push()
    assert any(flat_rewards(g.prompt_id) for b in plain_batches for g in b)
    assert plain.counts == {"prompts_drawn": 0 if mode == "ppo" else 4}


@pytest.mark.parametrize("mode", ["pipeline_rl", "ppo"])
@pytest.mark.parametrize("max_rounds", [1, 3])
def test_dynamic_sampling_cap_bounds_the_prompts_drawn_per_batch(mode, max_rounds):
    # Every group has zero variance: each batch draws up to the cap, then trains on
    # zero-variance groups (the zero-variance filter gives them no loss).
    pool = SimulatedPool(lambda pid: 2)
    scorer = FakeScorer(flat=lambda pid: True)
    k = 2
    source = dynamic_source(pool, mode, k=k, scorer=scorer, max_rounds=max_rounds)
    per_call = []
    for _ in range(6):
        batch = source.next_batch(pool.version)
        assert len(batch) == 4
        per_call.append(dict(source.counts))
        pool.push()
    dropped = [c["groups_dropped"] for c in per_call]
    drawn = [c["prompts_drawn"] for c in per_call]
    if mode == "ppo":  # one generation for k batches: k x B prompts, then the replacements
        assert drawn == [max_rounds * k * 4, 0] * 3
        assert dropped == [(max_rounds - 1) * k * 4, 0] * 3
        assert [c["groups_kept_over_cap"] for c in per_call] == [k * 4, 0] * 3
    else:  # B a step ((k + 1) B outstanding at the start), (max_rounds - 1) x B replacements
        assert all(d <= (max_rounds - 1) * 4 for d in dropped)
        assert dropped[0] == (max_rounds - 1) * 4 and drawn[0] == (k + 1) * 4 + dropped[0]
        assert all(n <= max_rounds * 4 for n in drawn[1:])
        assert drawn[-2:] == [max_rounds * 4] * 2 and dropped[-2:] == [(max_rounds - 1) * 4] * 2
    assert len(scorer.dropped) == sum(dropped)


@pytest.mark.parametrize("k", [1, 2, 8])
def test_dynamic_sampling_keeps_the_lag_bound(k):
    # Slow prompts (every 5th, 12x slower) and zero-variance prompts (every 3rd) together:
    # due groups are waited for and trained on unless zero-variance filters them out.
    pool = SimulatedPool(lambda pid: 24 if pid % 5 == 0 else 2)
    scorer = FakeScorer()
    source = dynamic_source(pool, "pipeline_rl", k=k, scorer=scorer)
    trained = []
    for _ in range(40):
        batch = source.next_batch(pool.version)
        assert len(batch) >= 4
        for group in batch:
            assert pool.version - min(s.oldest_version for s in group.samples) <= k
            assert not flat_rewards(group.prompt_id)
            trained.append(group.prompt_id)
        pool.push()
    assert len(trained) == len(set(trained))
    in_flight = set(source.in_flight_prompt_ids())
    assert set(pool.submitted) == set(trained) | set(scorer.dropped) | in_flight
    assert any(pid % 5 == 0 for pid in trained)  # slow prompts with variance: trained
    assert any(pid % 15 == 0 for pid in scorer.dropped)  # slow zero-variance ones: dropped


class ScriptedRewards:
    """A reward pool whose verdicts follow a script: prompt 0 gets 1 correct of 4 the first
    time it is generated and 4 of 4 every later time; the other prompts get 2 of 4."""

    def __init__(self):
        self.visits: dict[int, int] = {}
        self.last_statuses: list[str] = []
        self.last_crashes: list[int] = []

    def score_batch(self, texts, references, kinds):
        rewards = []
        for start in range(0, len(references), 4):  # one group of 4 samples after another
            pid = references[start]
            seen = self.visits.get(pid, 0)
            self.visits[pid] = seen + 1
            correct = (1 if seen == 0 else 4) if pid == 0 else 2
            rewards += [1.0] * correct + [-1.0] * (4 - correct)
        self.last_statuses = ["correct" if r > 0 else "wrong" for r in rewards]
        self.last_crashes = [0] * len(rewards)
        return rewards


@pytest.mark.parametrize("history", ["cumulative", "latest"])
def test_dropped_groups_count_in_the_no_positive_resampling_history(history):
    """The trainer's dynamic-sampling callbacks with the real sampler and pass-rate tracker:
    a zero-variance group is dropped, but its samples still enter the pass-rate history that
    retires prompts (threshold 0.9), compared as the lifetime or the latest pass rate."""
    from types import SimpleNamespace

    from megatron_rl.algorithms.pass_rate import PassRateTracker
    from megatron_rl.data.sampler import PromptSampler
    from megatron_rl.trainer.scoring import dynamic_sampling, score_groups

    tracker = PassRateTracker(0.9, history=history)
    sampler = PromptSampler(list(range(4)), shuffle=False, tracker=tracker)
    data = SimpleNamespace(
        get=lambda pid: SimpleNamespace(reference=pid, kind="math"), sources=["math"]
    )
    config = SimpleNamespace(data=SimpleNamespace(dynamic_sampling=True,
                                                  dynamic_sampling_max_rounds=8),
                             rollout=SimpleNamespace(episodes=False),
                             reward=SimpleNamespace(max_error_fraction=0.5))  # fmt: skip
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: "")
    run = SimpleNamespace(config=config, tokenizer=tokenizer, data=data, tracker=tracker,
                          rewards=ScriptedRewards())  # fmt: skip
    pool = SimulatedPool(lambda pid: 2)
    # k = 1: at most (k + 1) x B = 4 prompts outstanding, so none of the 4 is in flight twice
    # (the script counts visits in scoring order; two copies would be recorded out of order)
    source = RolloutSource(pool, sampler.next_prompts, lambda pid: [pid], 2, 4, "pipeline_rl",
                           1, dynamic=dynamic_sampling(run))  # fmt: skip
    trained, dropped = [], 0
    for _ in range(8):
        groups = source.next_batch(pool.version)
        samples, info = score_groups(run, groups, pool.version)
        trained += [g.prompt_id for g in groups]
        dropped += source.counts["groups_dropped"]
        assert all(0 < rate < 1 for rate in info["group_pass_rates"])
        pool.push()
    visits_of_0 = run.rewards.visits[0]
    assert trained.count(0) == 1 and dropped == visits_of_0 - 1 > 0
    if history == "latest":  # its first all-correct group (dropped) retired it
        assert tracker.is_retired(0) and visits_of_0 == 2
    else:  # lifetime: (1 + 4 n) / (4 + 4 n) reaches 0.9 at the 8th group (29 / 32)
        assert tracker.pass_rate(0) == pytest.approx(
            (1 + 4 * (visits_of_0 - 1)) / (4 * visits_of_0)
        )
        assert tracker.is_retired(0) == (visits_of_0 >= 8)
        assert visits_of_0 > 2


@pytest.mark.parametrize("mode", ["pipeline_rl", "ppo"])
def test_dynamic_sampling_resume_regenerates_exactly_the_prompts_in_flight(mode):
    """A checkpoint records the in-flight prompt ids (loop.checkpointed: InFlight) and the
    sampler's position; a resumed source regenerates those: every drawn prompt is trained
    on or dropped exactly once over the two runs."""
    from megatron_rl.trainer.rollout_source import DynamicSampling

    scorer = FakeScorer()

    def source_at(first_id, pool):
        ids = iter(range(first_id, 10**6))
        dynamic = DynamicSampling(scorer.score, scorer.discard, 8)
        return RolloutSource(pool, lambda n: [next(ids) for _ in range(n)], lambda pid: [pid],
                             4, 2, mode, 2, dynamic=dynamic)  # fmt: skip

    pool = SimulatedPool(lambda pid: 2 + pid % 4)
    source, trained = source_at(0, pool), []
    for _ in range(3):  # PPO-off-policy-2: the checkpoint falls between the two batches
        trained += [g.prompt_id for g in source.next_batch(pool.version)]
        pool.push()
    carry, drawn = source.in_flight_prompt_ids(), len(pool.submitted)
    assert carry and sorted(trained + scorer.dropped + carry) == list(range(drawn))
    resumed_pool = SimulatedPool(lambda pid: 2 + pid % 4)
    resumed_pool.version = pool.version
    resumed = source_at(drawn, resumed_pool)
    resumed.submit(carry)
    for _ in range(3):
        trained += [g.prompt_id for g in resumed.next_batch(resumed_pool.version)]
        resumed_pool.push()
    done = trained + scorer.dropped
    assert len(done) == len(set(done)) and set(carry) <= set(done)
    assert set(done) | set(resumed.in_flight_prompt_ids()) == set(range(len(set(
        pool.submitted + resumed_pool.submitted))))  # fmt: skip


# -- continuous generation (PipelineRL) ---------------------------------------------------------


class ClockPool(RolloutClient):
    """A pool on a tick clock: prompt p's samples finish ``length(p)`` ticks after submission
    (tokens carry the version current at each tick). Time passes by ``advance`` (the trainer's
    update) and by waiting polls (``poll(timeout > 0)``: one tick). Every submission checks,
    against the test's own count of handed-out groups, the lag bound on outstanding prompts and
    the capacity. Thread-safe: the feeder thread polls while the test advances the clock."""

    def __init__(self, length, k, batch, capacity):
        self.length, self.k, self.batch, self.capacity = length, k, batch, capacity
        self.version = self.now = self._next = 0
        self._live: dict[int, tuple[int, list[Sample]]] = {}  # index -> (end tick, samples)
        self._done: list[Sample] = []
        self.submitted: list[int] = []
        self.handed = 0  # groups the test got from next_batch
        self.cut_version: int | None = None  # version of the test's last batch
        self.max_seqs = 0
        self.submit_threads: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, prompts, samples_per_prompt, seeds=None):
        with self._lock:
            out = []
            for prompt in prompts:
                index, self._next = self._next, self._next + 1
                samples = [Sample(index, j, list(prompt)) for j in range(samples_per_prompt)]
                self._live[index] = (self.now + self.length(prompt[0]), samples)
                self.submitted.append(prompt[0])
                out.append(index)
            outstanding = len(self.submitted) - self.handed
            cut = int(self.cut_version == self.version)
            assert outstanding <= (self.k + 1 - cut) * self.batch, (outstanding, cut)
            seqs = sum(len(s) for _, s in self._live.values())
            assert seqs <= self.capacity
            self.max_seqs = max(self.max_seqs, seqs)
            self.submit_threads.add(threading.current_thread().name)
            return out

    def advance(self, ticks=1):
        with self._lock:
            for _ in range(ticks):
                self.now += 1
                for index, (end, samples) in list(self._live.items()):
                    for s in samples:
                        s.append([7], [-1.0], self.version, True)
                    if self.now >= end:
                        self._done.extend(samples)
                        del self._live[index]

    def poll(self, timeout=0.0):
        if timeout > 0 and not self._done and self._live:
            self.advance()
        with self._lock:
            done, self._done = self._done, []
            return done

    def push(self):
        with self._lock:
            self.version += 1


def run_continuous(k, steps=40, batch=4, group=2, capacity=48, update_ticks=1):
    """PipelineRL-k against a ClockPool whose generation is slower than the update (lengths
    16..24 ticks, updates of 1 tick): returns the pool, the source's per-step load metrics
    (from step 10 on) and the per-token lag histogram of the trained batches (counted here)."""
    from megatron_rl.trainer.rollout_source import token_lag_histogram

    pool = ClockPool(lambda pid: 16 + pid % 9, k, batch, capacity)
    counter = iter(range(10**6))
    source = RolloutSource(pool, lambda n: [next(counter) for _ in range(n)], lambda pid: [pid],
                           batch, group, "pipeline_rl", k, capacity=capacity,
                           clock=lambda: pool.now)  # fmt: skip
    loads, lags, trained = [], [], []
    for step in range(steps):
        groups = source.next_batch(pool.version)
        pool.handed += len(groups)
        pool.cut_version = pool.version
        trained += [g.prompt_id for g in groups]
        mine = [pool.version - v for g in groups for s in g.samples for v in s.versions]
        assert token_lag_histogram(groups, pool.version, k) == [mine.count(i) for i in range(k + 1)]
        for _ in range(update_ticks):  # the feeder polls while the trainer updates
            pool.advance()
            source.feed()
        if step >= 10:
            loads.append(source.generator_load())
            lags += mine
        pool.push()
    assert len(trained) == len(set(trained))  # nothing twice, nothing dropped:
    assert set(pool.submitted) == set(trained) | set(source.in_flight_prompt_ids())
    return pool, loads, lags


def test_k_sets_the_in_flight_amount_and_the_staleness():
    results = {k: run_continuous(k) for k in (1, 4, 8)}
    occupancy = {k: sum(d["pool_occupancy"] for d in r[1]) / len(r[1]) for k, r in results.items()}
    mean_lag = {k: sum(r[2]) / len(r[2]) for k, r in results.items()}
    for k, (pool, loads, lags) in results.items():
        assert max(lags) <= k  # the lag bound, per token
        # in flight: at most (k + 1) x B prompts of G = 2 samples, at most the capacity (48)
        assert pool.max_seqs == min((k + 1) * 4 * 2, 48)
        assert all(0 <= d["generator_idle_fraction"] <= 1 for d in loads)
    # More k, more in flight (up to the capacity: k = 8 would allow 72 sequences) ...
    assert occupancy[1] < 0.4 < occupancy[4] < occupancy[8] and occupancy[8] > 0.9
    # ... and older tokens: the histogram moves to larger lags, up to k where it binds.
    assert mean_lag[1] < mean_lag[4] < mean_lag[8]
    assert max(results[4][2]) == 4 and max(results[1][2]) == 1
    # The trainer waits less for due groups: 40 steps take less time (ticks) as k grows.
    assert results[1][0].now > results[4][0].now > results[8][0].now
    # The generator never idles with continuous generation (the pool is refilled at once).
    assert all(d["generator_idle_fraction"] == 0 for r in results.values() for d in r[1])


def test_the_feeder_tops_the_pool_up_while_the_trainer_updates():
    import time

    # capacity 8 sequences = 4 prompts of G = 2: the capacity, not the lag bound, binds
    k, batch, group, capacity = 2, 4, 2, 8
    pool = ClockPool(lambda pid: 3, k, batch, capacity)
    counter = iter(range(10**6))
    source = RolloutSource(pool, lambda n: [next(counter) for _ in range(n)], lambda pid: [pid],
                           batch, group, "pipeline_rl", k, capacity=capacity)  # fmt: skip
    for _ in range(3):
        groups = source.next_batch(pool.version)
        pool.handed += len(groups)
        pool.cut_version = pool.version
        assert all(pool.version - v <= k for g in groups for s in g.samples for v in s.versions)
        before = len(pool.submitted)
        assert pool.max_seqs == capacity and source.outstanding == 4  # the 4 in flight
        with source.feeding():  # the update: 3 ticks finish the 4 prompts in flight
            pool.advance(3)
            deadline = time.monotonic() + 30
            while len(pool.submitted) < before + 4 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.1)  # more polls: nothing more fits (capacity full, k x B outstanding)
            fed = len(pool.submitted) - before
        assert fed == 4 and source.outstanding == k * batch
        pool.push()
    assert "rollout-feeder" in pool.submit_threads  # submitted by the feeder thread


def test_a_feeder_error_is_raised_after_the_update():
    pool = ClockPool(lambda pid: 3, 2, 4, capacity=100)
    source = RolloutSource(pool, lambda n: list(range(n)), lambda pid: [pid], 4, 2,
                           "pipeline_rl", 2, capacity=100)  # fmt: skip

    def broken(timeout=0.0):
        raise RuntimeError("vLLM engine 0 failed")

    pool.poll = broken
    with pytest.raises(RuntimeError, match="rollout feeder failed") as info:
        with source.feeding():
            pass
    assert "engine 0 failed" in str(info.value.__cause__)


@pytest.mark.parametrize("mode", ["ppo", "pipeline_rl"])
def test_next_batch_after_weights_needed_goes_on_without_drawing_again(mode):
    """Elastic engines: while a batch is awaited the pool asks for weights (a restarted
    engine); the trainer re-sends them and asks again. The second call resumes the first:
    PPO submits its k x B prompts once, PipelineRL tops up within the same bound."""
    from megatron_rl.rollout.client import WeightsNeeded

    pool = SimulatedPool(lambda pid: 3)
    answers = iter([False, True])  # the second wait for samples finds an engine waiting
    pool.needs_weights = lambda: next(answers, False)
    source = make_source(pool, mode, k=2)
    with pytest.raises(WeightsNeeded):
        source.next_batch(pool.version)
    drawn = list(pool.submitted)
    assert len(drawn) == (8 if mode == "ppo" else 12)  # k x B / (k + 1) x B
    first = source.next_batch(pool.version)
    assert pool.submitted == drawn and len(first) == 4
    if mode == "ppo":
        second = source.next_batch(pool.version)
        trained = [g.prompt_id for g in first + second]
        assert sorted(trained) == sorted(drawn)  # each prompt once, in the two batches
        assert source.counts["prompts_drawn"] == 0  # a batch of the same generation
    else:
        assert {g.prompt_id for g in first} <= set(drawn)

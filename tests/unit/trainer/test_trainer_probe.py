"""The post-push log-prob probe: its schedule, what it keeps, what it measures, when it stops."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models import ModelConfig
from megatron_rl.models.logprobs import token_logprobs
from megatron_rl.models.provider import build_model
from megatron_rl.platform import ParallelConfig
from megatron_rl.rollout.samples import Sample
from megatron_rl.trainer.batch import TrainSample
from megatron_rl.trainer.optim import wrap_model
from megatron_rl.trainer.probe import LogprobProbe, ProbeResult, measure_gap
from megatron_rl.trainer.step import LogprobGapError


def probe(every=3, samples=2, limit=1e-3, start_step=0, prompt_ids=(10, 11, 12)):
    return LogprobProbe(
        prompt_ids,
        encode=lambda i: [3, 4, i],
        every=every,
        samples=samples,
        max_tokens=5,
        temperature=0.7,
        limit=limit,
        seed=1,
        start_step=start_step,
    )


def due_steps(p, pushes):
    return [step for step in range(1, 13) if p.due(step, step in pushes)]


def test_probe_schedule_is_the_first_push_of_every_window():
    every_step = set(range(1, 13))
    assert due_steps(probe(every=3), every_step) == [3, 6, 9, 12]  # PipelineRL
    # PPO-off-policy-2 pushes at even steps: windows [3, 5], [6, 8], [9, 11], [12, ...]
    assert due_steps(probe(every=3), {2, 4, 6, 8, 10, 12}) == [4, 6, 10, 12]
    assert due_steps(probe(every=1), {5, 7}) == [5, 7]  # never without a push
    assert due_steps(probe(every=0), every_step) == []
    assert due_steps(probe(every=3, start_step=7), set(range(8, 13))) == [9, 12]  # resumed
    assert due_steps(probe(every=1, prompt_ids=()), every_step) == []  # no prompts: off


class FakePool:
    """What the probe asks of a GeneratorPool: its version and a blocking generate."""

    def __init__(self, version, made):
        self.version, self.made, self.calls = version, made, []

    def generate(self, prompts, **settings):
        self.calls.append((prompts, settings))
        return [self.made(k, p) for k, p in enumerate(prompts)]


def test_probe_keeps_only_samples_generated_entirely_at_the_pushed_version():
    def made(k, prompt):
        versions = {0: [4, 4, 4], 1: [3, 4, 4], 2: [4, 4, 4]}[k]  # 1 started before a push
        s = Sample(k, 0, list(prompt), [7, 8, 9], [-0.1, -0.2, -0.3], versions)
        s.mask = [True, k != 2, True]  # sample 2: a token appended by an interruption
        return s

    p = probe(every=1, samples=3, prompt_ids=(10, 11, 12, 13))
    pool = FakePool(4, made)
    version, kept, discarded = p.generate(pool, step=1)
    assert (version, discarded) == (4, 1)
    assert [s.prompt_id for s in kept] == [13, 11]  # the list in turn: from 3 = step 1 x 3
    assert kept[1].policy_mask == [True, False, True] and kept[0].versions == [4, 4, 4]
    assert kept[0].prompt_tokens == [3, 4, 13] and kept[0].gen_logprobs == [-0.1, -0.2, -0.3]
    assert all(s.reward == 0.0 for s in kept)
    prompts, settings = pool.calls[0]
    assert prompts == [[3, 4, 13], [3, 4, 10], [3, 4, 11]]
    assert settings["samples_per_prompt"] == 1 and settings["max_tokens"] == 5
    assert settings["temperature"] == 0.7 and len(set(settings["seeds"])) == 3
    p.generate(pool, step=1)  # seeded: reproducible
    assert pool.calls[1][1]["seeds"] == settings["seeds"]
    p.generate(pool, step=2)
    assert pool.calls[2][1]["seeds"] != settings["seeds"]


def test_probe_check_raises_above_the_limit_only():
    def result(gap, tokens=10):
        return ProbeResult(5, gap, tokens, 2 * gap, 2, 0, 0.1)

    with pytest.raises(LogprobGapError, match="version 5.*max_logprob_gap 0.001.*check-parity"):
        probe(limit=1e-3).check(result(0.02))
    probe(limit=1e-3).check(result(5e-4))
    probe(limit=1e-3).check(result(float("nan"), tokens=0))  # nothing measured: no verdict
    probe(limit=None).check(result(0.5))  # check_logprob_gap off: logged only
    probe().check(None)  # not due
    assert result(0.02).metrics()["logprob_probe_tokens"] == 10


@pytest.fixture
def model(megatron_single_rank):
    torch.manual_seed(0)
    return wrap_model(
        build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())
    )


def test_measure_gap_against_hand_made_offsets_without_touching_gradients(model):
    """Generator log-probs = the trainer's + known offsets: the probe's mean and max are the
    offsets' over the policy tokens of samples of the probed version, and nothing else."""
    gen = torch.Generator().manual_seed(3)
    samples = []
    for k, n in enumerate((5, 3, 4)):
        prompt = torch.randint(3, 128, (4 + k,), generator=gen).tolist()
        response = torch.randint(3, 128, (n,), generator=gen).tolist()
        with torch.no_grad():
            lp = token_logprobs(model, torch.tensor([prompt + response]), 0.7)[0, len(prompt) - 1 :]
        samples.append(TrainSample(k, k, prompt, response, lp.tolist(), [True] * n, 0.0, [6] * n))
    offsets = {0: [0.01] * 5, 1: [0.0, 0.05, 0.0], 2: [0.3] * 4}
    samples[1].policy_mask[2] = False  # interruption text: not the policy's
    samples[2].versions[0] = 5  # started before the push: excluded
    for k, s in enumerate(samples):
        s.gen_logprobs = [g + o for g, o in zip(s.gen_logprobs, offsets[k])]
    grads = [torch.rand_like(p.main_grad) for p in model.module.parameters()]
    for p, g in zip(model.module.parameters(), grads):
        p.main_grad.copy_(g)
    gap, tokens, worst = measure_gap(model, samples, version=6, temperature=0.7)
    assert tokens == 5 + 2
    assert gap == pytest.approx((0.05 + 0.05) / 7, abs=1e-5)
    assert worst == pytest.approx(0.05, abs=1e-5)
    for p, g in zip(model.module.parameters(), grads):
        assert torch.equal(p.main_grad, g)  # forward only
    _, none, _ = measure_gap(model, samples, version=7, temperature=0.7)
    assert none == 0

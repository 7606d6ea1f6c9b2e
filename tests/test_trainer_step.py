"""The policy update: micro-batching is exact, filters act, CISPO moves log-probs the right way."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.models import ModelConfig
from megatron_rl.models.logprobs import token_logprobs
from megatron_rl.models.provider import build_model
from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer.batch import TrainSample, make_micro_batches
from megatron_rl.trainer.step import advantages_and_keep, policy_update
from megatron_rl.trainer.warm_start import supervised_warm_start


@pytest.fixture(scope="module")
def base(megatron_single_rank_module):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())
    return model, {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


@pytest.fixture
def model(base, megatron_single_rank):
    """The module-wide model, reset to its initial weights (megatron models do not deepcopy)."""
    model, state = base
    model.load_state_dict(state, strict=False)
    return model


def make_samples(model, rewards_by_group, seed=0):
    """Samples with random prompts/responses and on-policy generator log-probs."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for group, rewards in enumerate(rewards_by_group):
        prompt = torch.randint(
            3, 128, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen
        ).tolist()
        for r in rewards:
            n = int(torch.randint(2, 9, (1,), generator=gen))
            response = torch.randint(3, 128, (n,), generator=gen).tolist()
            with torch.no_grad():
                lp = token_logprobs(model, torch.tensor([prompt + response]))[0, len(prompt) - 1 :]
            samples.append(
                TrainSample(
                    group * 10, group, prompt, response, lp.tolist(), [True] * n, r, [0] * n
                )
            )
    return samples


def params_after(model, samples, algo, micro_batch_size):
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    result = policy_update(model, opt, samples, algo, micro_batch_size, grad_clip=0.0)
    after = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(before[k])
    return after, result


def test_micro_batching_gives_the_same_update(model):
    samples = make_samples(model, [[1, -1, -1], [1, 1, -1], [-1, -1, -1], [1, -1, 1]])
    for agg in ("prompt", "sample", "token"):
        algo = AlgorithmConfig(aggregation=agg)
        full, _ = params_after(model, samples, algo, micro_batch_size=len(samples))
        split, _ = params_after(model, samples, algo, micro_batch_size=5)
        assert torch.allclose(full, split, atol=1e-6), agg


def test_zero_variance_groups_contribute_nothing(model):
    samples = make_samples(model, [[1, -1, -1], [-1, -1, -1], [1, 1, -1]])
    algo = AlgorithmConfig()
    adv, keep = advantages_and_keep(samples, algo)
    assert keep.tolist() == [True] * 3 + [False] * 3 + [True] * 3
    assert (adv[3:6] == 0).all()
    with_zero, res = params_after(model, samples, algo, 4)
    assert res.effective_batch_fraction == pytest.approx(6 / 9)
    without = [s for s in samples if s.group != 1]
    without_zero, _ = params_after(model, without, algo, 4)
    assert torch.allclose(with_zero, without_zero, atol=1e-7)


def test_cispo_update_raises_logprob_of_rewarded_samples(model):
    samples = make_samples(model, [[1, -1], [-1, 1]], seed=3)
    m = model
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    res = policy_update(m, opt, samples, AlgorithmConfig(), micro_batch_size=4)
    assert res.rho_mean == pytest.approx(1.0, abs=1e-5)  # on-policy: trainer == generator
    assert res.abs_logprob_diff < 1e-5 and res.num_tokens == sum(
        len(s.response_tokens) for s in samples
    )
    for s in samples:
        tokens = torch.tensor([s.prompt_tokens + s.response_tokens])
        with torch.no_grad():
            new = token_logprobs(m, tokens)[0, len(s.prompt_tokens) - 1 :].sum()
        moved = float(new) - sum(s.gen_logprobs)
        assert moved * s.reward > 0, (s.reward, moved)


def test_interruption_tokens_get_no_loss(model):
    samples = make_samples(model, [[1, -1]])
    samples[0].policy_mask[0] = False
    adv, keep = advantages_and_keep(samples, AlgorithmConfig())
    mb = make_micro_batches(samples, adv, keep, 8)[0]
    assert mb.loss_mask.tolist() == samples[0].policy_mask + samples[1].policy_mask
    assert int(mb.select.sum()) == mb.loss_mask.numel()


def test_warm_start_lowers_the_loss(model):
    m = model
    examples = [([5, 6, 7], [8, 9, 10, 2]), ([11, 12], [13, 14, 2])]
    losses = supervised_warm_start(m, examples, steps=30, lr=3e-3, batch_size=2)
    assert losses[-1] < 0.2 * losses[0]


def test_data_parallel_update_equals_single_rank(tmp_path):
    """Two DP ranks, each training on half the groups, make the single-rank update exactly."""
    from mp_workers import dp_update_worker

    from megatron_rl.platform import run_local_ranks

    gen = torch.Generator().manual_seed(11)
    samples = []
    for group, rewards in enumerate([[1, -1, -1], [1, 1, 1], [-1, 1, -1], [1, -1, 1], [-1, -1, 1]]):
        prompt = torch.randint(3, 128, (4,), generator=gen).tolist()
        for r in rewards:
            n = int(torch.randint(2, 7, (1,), generator=gen))
            samples.append(
                TrainSample(
                    group, group, prompt, torch.randint(3, 128, (n,), generator=gen).tolist(),
                    (-torch.rand(n, generator=gen) * 5).tolist(), [True] * n, float(r), [0] * n,
                )
            )  # fmt: skip
    run_local_ranks(dp_update_worker, 1, samples, str(tmp_path / "one.pt"), 1)
    run_local_ranks(dp_update_worker, 2, samples, str(tmp_path / "two.pt"), 2)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one.keys() == two.keys()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-6), key

"""The policy update: micro-batching is exact, filters act, CISPO moves log-probs the right way."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.config.sections import OptimizerConfig
from megatron_rl.models import ModelConfig
from megatron_rl.models.logprobs import token_logprobs
from megatron_rl.models.provider import build_model
from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer.batch import (
    TrainSample,
    make_micro_batches,
    plan_micro_batches,
    token_multiple,
)
from megatron_rl.trainer.optim import build_optimizer, wrap_model
from megatron_rl.trainer.step import (
    LogprobGapError,
    advantages_and_keep,
    policy_update,
    shaped_rewards,
)
from megatron_rl.trainer.warm_start import supervised_warm_start


@pytest.fixture
def model(megatron_single_rank):
    """The tiny model (seeded) in megatron's DDP wrapper, as the trainer runs it."""
    torch.manual_seed(0)
    return wrap_model(
        build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())
    )


def sgd(ddp, lr: float = 1.0):
    """Megatron's SGD (no momentum, decay or clipping): an update that is the raw gradient."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(optimizer="sgd", lr=lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0)
    return get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)


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


def params_after(model, samples, algo, micro_batch_size, **kwargs):
    before = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    result = policy_update(model, sgd(model), samples, algo, micro_batch_size, **kwargs)
    after = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
    with torch.no_grad():
        for k, p in model.module.named_parameters():
            p.copy_(before[k])
    return after, result


def test_length_penalty_on_correct_or_all_samples():
    # l_max 10, l_cache 4: -(len - 6) / 4 from 6 tokens on, -1 from 10 (by hand)
    samples = [
        TrainSample(0, 0, [1], [5] * n, [0.0] * n, [True] * n, r, [0] * n)
        for n, r in ((6, 1.0), (8, 1.0), (12, 1.0), (8, -1.0), (12, -1.0))
    ]
    scalerl = AlgorithmConfig(
        length_penalty=True, length_penalty_l_max=10, length_penalty_l_cache=4
    )
    assert shaped_rewards(samples, scalerl).tolist() == [1.0, 0.5, 0.0, -1.0, -1.0]
    dapo = AlgorithmConfig(
        length_penalty=True,
        length_penalty_l_max=10,
        length_penalty_l_cache=4,
        length_penalty_on="all",
    )
    assert shaped_rewards(samples, dapo).tolist() == [1.0, 0.5, 0.0, -1.5, -2.0]


def test_micro_batching_gives_the_same_update(model):
    samples = make_samples(model, [[1, -1, -1], [1, 1, -1], [-1, -1, -1], [1, -1, 1]])
    for agg in ("prompt", "sample", "token"):
        algo = AlgorithmConfig(aggregation=agg)
        full, _ = params_after(model, samples, algo, micro_batch_size=len(samples))
        split, _ = params_after(model, samples, algo, micro_batch_size=5)
        assert torch.allclose(full, split, atol=1e-6), agg
        longest = max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples)
        budget, _ = params_after(model, samples, algo, None, micro_batch_tokens=3 * longest)
        assert torch.allclose(full, budget, atol=1e-6), agg


def test_micro_batches_take_the_longest_first_and_fill_the_token_budget():
    lengths = [10, 40, 12, 38, 20, 5]  # longest first: indices 1, 3, 4, 2, 0, 5
    assert plan_micro_batches(lengths, tokens=80) == [[1, 3], [4, 2, 0, 5]]  # 2 x 40, 4 x 20
    assert plan_micro_batches(lengths, tokens=79) == [[1], [3, 4], [2, 0, 5]]  # 2 x 38, 3 x 12
    # FP8 rounding: widths 48, 48, 32: two of 48, three of 32 fit 96
    assert plan_micro_batches(lengths, tokens=96, multiple=16) == [[1, 3], [4, 2, 0], [5]]
    assert plan_micro_batches(lengths, size=4) == [[1, 3, 4, 2], [0, 5]]
    assert plan_micro_batches([100, 3], tokens=50) == [[0], [1]]  # too long: one of its own
    assert plan_micro_batches([7, 7, 7], tokens=14) == [[0, 1], [2]]  # ties keep their order
    with pytest.raises(ValueError, match="give size or tokens"):
        plan_micro_batches(lengths, size=2, tokens=80)


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


def test_zero_variance_samples_are_not_forwarded_for_the_update(model):
    """The update's forward and backward take only the groups with reward variance; with a
    monitored version the zero-variance samples get a forward alone, without gradients (their
    log-prob gap), and the update is the same."""
    samples = make_samples(model, [[1, -1, -1], [-1, -1, -1], [1, 1, -1]], seed=3)
    for s in samples:
        s.versions = [2] * len(s.versions)
    seen = []  # (sequences, gradients on) of every embedding forward
    hook = model.module.embedding.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(
            ((args or [kwargs["input_ids"]])[0].shape[0], torch.is_grad_enabled())
        ),
        with_kwargs=True,
    )
    try:
        plain, res = params_after(model, samples, AlgorithmConfig(), 4)
        assert sorted(seen) == [(2, True), (4, True)]  # groups 0 and 2: 6 of the 9 samples
        assert res.effective_batch_fraction == pytest.approx(6 / 9)
        seen.clear()
        watched, res = params_after(model, samples, AlgorithmConfig(), 4, monitor_version=2)
        assert sorted(seen) == [(2, True), (3, False), (4, True)]
        assert res.logprob_gap_tokens == sum(len(s.response_tokens) for s in samples)
    finally:
        hook.remove()
    assert torch.equal(plain, watched)


def test_cispo_update_raises_logprob_of_rewarded_samples(model):
    samples = make_samples(model, [[1, -1], [-1, 1]], seed=3)
    m = model
    opt = build_optimizer(m, OptimizerConfig(lr=1e-3, warmup_steps=0, eps=1e-8)).optimizer
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
    for i, sample in enumerate(samples):  # the micro-batch holds the longest first
        assert mb.loss_mask[mb.sample_ids == i].tolist() == sample.policy_mask
    assert int(mb.select.sum()) == mb.loss_mask.numel()


def test_warm_start_lowers_the_loss(model):
    m = model
    examples = [([5, 6, 7], [8, 9, 10, 2]), ([11, 12], [13, 14, 2])]
    losses = supervised_warm_start(m, examples, steps=30, lr=3e-3, batch_size=2)
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize(
    "overlap,pack",
    [(False, False), (True, False), (False, True)],
    ids=["sync", "overlap", "packed"],
)
def test_data_parallel_update_equals_single_rank(tmp_path, overlap, pack):
    """Two DP ranks, each training on half the groups, make the single-rank update exactly
    (also with the gradient reduction overlapped with the backward, as on GPU; and with packed
    micro-batches, 4 and 5 on the two ranks: the one with fewer runs an empty one,
    against the padded single rank)."""
    from support.mp_workers import dp_update_worker

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
    run_local_ranks(dp_update_worker, 2, samples, str(tmp_path / "two.pt"), 2, overlap, pack)
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one.keys() == two.keys()
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-6), key
    # The groups went to the ranks by tokens: the best split of the trained groups' tokens
    # (group 1's rewards are all equal: filtered), found here by trying every split.
    tokens = {}
    for s in samples:
        if s.group != 1:
            tokens[s.group] = tokens.get(s.group, 0) + len(s.prompt_tokens) + len(s.response_tokens)
    total = sum(tokens.values())
    best = min(
        max(part := sum(t for g, t in tokens.items() if mask >> g & 1), total - part)
        for mask in range(2**5)
    )
    assert float((tmp_path / "two.pt.imbalance").read_text()) == pytest.approx(best / (total / 2))
    assert float((tmp_path / "one.pt.imbalance").read_text()) == 1.0


def random_samples(seed: int, vocab: int = 128) -> list[TrainSample]:
    """Five groups of three samples with off-policy generator log-probs (rho != 1)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for group, rewards in enumerate([[1, -1, -1], [1, 1, 1], [-1, 1, -1], [1, -1, 1], [-1, -1, 1]]):
        prompt = torch.randint(
            3, vocab, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen
        ).tolist()
        for r in rewards:
            n = int(torch.randint(2, 7, (1,), generator=gen))
            samples.append(
                TrainSample(
                    group, group, prompt, torch.randint(3, vocab, (n,), generator=gen).tolist(),
                    (-torch.rand(n, generator=gen) * 5).tolist(), [True] * n, float(r), [0] * n,
                )
            )  # fmt: skip
    return samples


def with_random_routing(samples: list[TrainSample], seed: int) -> list[TrainSample]:
    """``samples`` with random generator routing for tiny-llama4 (4 experts, top-1, MoE
    layers 1 and 3): rows for every position but the last, as engines record them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in samples:
        rows = torch.zeros((len(s.prompt_tokens) + len(s.response_tokens) - 1, 4, 1))
        rows[:, [1, 3]] = torch.randint(0, 4, (len(rows), 2, 1), generator=gen).float()
        out.append(dataclasses.replace(s, routed_experts=rows.to(torch.uint8).numpy()))
    return out


LAYOUTS = [
    ("tiny-llama", {"tensor": 2}),
    ("tiny-llama", {"pipeline": 2}),
    ("tiny-llama4", {"expert": 2}),
    # megatron trains MoE with TP only under sequence parallelism; with routing replay each
    # TP rank takes the rows of its sequence-parallel chunk (free TP+EP routing: the EP run,
    # the logits of test_models.py, and the loop's EP run)
    ("tiny-llama4", {"tensor": 2, "expert": 2, "sequence_parallel": True, "replay": True}),
    # and each pipeline stage's routers the rows of their global layers
    ("tiny-llama4", {"pipeline": 2, "replay": True}),
    # packed micro-batches (batch.pack) in the layouts that cut or pass the sequence (sequence
    # parallelism, a pipeline with replayed routing) make the padded one-rank update
    ("tiny-llama", {"tensor": 2, "sequence_parallel": True, "pack": True}),
    (
        "tiny-llama4",
        {"tensor": 2, "expert": 2, "sequence_parallel": True, "replay": True, "pack": True},
    ),
    ("tiny-llama4", {"pipeline": 2, "replay": True, "pack": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset,layout", LAYOUTS, ids=lambda v: str(v))
def test_update_in_a_parallel_layout_equals_one_rank(preset, layout, tiny_hf_dirs, tmp_path):
    """TP, PP (megatron's pipeline schedule) and EP (experts exchanged by all-to-all, expert
    gradients reduced over the expert-data-parallel group) make the one-rank update, to
    float rounding: the SGD (lr 1) update is the gradient itself. With routing replay, the
    replayed (random) routing differs from the model's own, so a rank that took the wrong
    rows would route differently and change the update."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file
    from support.mp_workers import layout_update_worker

    from megatron_rl.platform import run_local_ranks

    layout = dict(layout)
    replay = layout.pop("replay", False)
    pack = layout.pop("pack", False)  # the many ranks' micro-batches; the one rank's padded
    samples = with_random_routing(random_samples(3), 4) if replay else random_samples(3)
    outs = {}
    for name, lay, world in (("one", {}, 1), ("many", layout, 2)):
        out = str(tmp_path / f"{name}.pt")
        shutil.copytree(tiny_hf_dirs[preset], out + ".hf")
        run_local_ranks(
            layout_update_worker, world, preset, lay, samples, out, replay, pack and world > 1
        )
        outs[name] = torch.load(out, weights_only=False)
    one, many = outs["one"], outs["many"]
    if replay:  # the routers of rank 0 replayed (a stage: its own MoE layer, 1 of 1 and 3)
        assert set(one["replayed"]) == {1, 3} and set(many["replayed"]) <= {1, 3}
        assert many["replayed"]
    assert one["weights"].keys() == many["weights"].keys()
    for key, ref in one["weights"].items():  # updates are up to ~0.1
        assert torch.allclose(ref, many["weights"][key], atol=1e-6, rtol=0), key
    initial = load_file(str(Path(tiny_hf_dirs[preset]) / "model.safetensors"))
    assert max(float((one["weights"][k] - initial[k]).abs().max()) for k in initial) > 1e-2
    for field in ("loss", "grad_norm", "rho_mean", "abs_logprob_diff"):
        assert getattr(many["result"], field) == pytest.approx(
            getattr(one["result"], field), rel=1e-4
        ), field
    assert many["result"].num_tokens == one["result"].num_tokens > 0
    if preset == "tiny-llama4":  # expert load: every rank's routed tokens, summed
        for name, lay in (("one", {}), ("many", layout)):
            load = outs[name]["result"].expert_load
            expected = routed_tokens(samples, lay, micro_batch_size=2, world=1 + (name == "many"))
            assert load.tokens.tolist() == [expected] * len(load.layers), name
            assert load.tokens_per_expert.sum(dim=1).tolist() == load.tokens.tolist()
            assert float(load.dropped.sum()) == 0.0


def routed_tokens(samples, layout: dict, micro_batch_size: int, world: int) -> float:
    """Tokens one MoE layer routes in a step, by hand: each data-parallel rank's groups with
    reward variance (zero-variance ones are not forwarded) in micro-batches (longest sequences
    first), their padding (to their longest sequence, and to a multiple of TP under sequence
    parallelism) left out as megatron's padding_mask says, plus the 2-token empty
    micro-batches of ranks with fewer (unmasked)."""
    tp = layout.get("tensor", 1)
    dp = world // (tp * layout.get("pipeline", 1))
    multiple = tp if layout.get("sequence_parallel") else 1
    pad = lambda n: -(-n // multiple) * multiple  # noqa: E731
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.group, set()).add(s.reward)
    # Which rank trains which group is trainer/balance.py's choice (tested in test_balance.py;
    # here only the counting is under test): the same partition of the trained groups.
    from megatron_rl.trainer.balance import assign_groups

    kept = [len(rewards[s.group]) > 1 for s in samples]
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
    owner = assign_groups([s.group for s in samples], lengths, kept, [False] * len(samples), dp)
    per_rank = []
    for r in range(dp):
        mine = [s for s in samples if owner[s.group] == r and len(rewards[s.group]) > 1]
        mine.sort(key=lambda s: -(len(s.prompt_tokens) + len(s.response_tokens)))
        chunks = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
        per_rank.append(
            [sum(len(s.prompt_tokens) + len(s.response_tokens) for s in c) for c in chunks]
        )
    count = max(len(t) for t in per_rank)
    return float(sum(sum(t) + (count - len(t)) * pad(2) for t in per_rank))


def test_logprob_gap_is_measured_on_every_on_policy_token(model):
    """All policy tokens of samples made by the trainer's current version count, those of
    zero-variance groups included; interruption tokens and stale samples do not."""
    samples = make_samples(model, [[1, -1], [-1, -1], [1, 1]], seed=5)
    samples[0].policy_mask[0] = False  # an interruption token
    stale = samples[5]
    stale.versions = [3] * (len(stale.versions) - 1) + [4]  # started before the last push
    stale.gen_logprobs = [lp - 0.5 for lp in stale.gen_logprobs]  # policy drift: not a fault
    for s in samples:
        s.versions = [4] * len(s.versions) if s is not stale else s.versions
    _, res = params_after(model, samples, AlgorithmConfig(), 4, monitor_version=4)
    expected = sum(sum(s.policy_mask) for s in samples if s is not stale)
    assert res.logprob_gap_tokens == expected
    assert res.logprob_gap < 1e-5
    _, ahead = params_after(model, samples, AlgorithmConfig(), 4, monitor_version=None)
    assert ahead.logprob_gap_tokens == 0  # trainer ahead of every sample: nothing exact


def test_logprob_gap_above_the_limit_stops_before_the_update(model):
    samples = make_samples(model, [[1, -1], [-1, 1]], seed=6)
    for s in samples:
        s.versions = [2] * len(s.versions)
    broken = samples[1]  # one sample from a generator with a stale head: off by 0.06 / token
    broken.gen_logprobs = [lp + 0.06 for lp in broken.gen_logprobs]
    before = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
    with pytest.raises(LogprobGapError, match="max_logprob_gap 0.001.*check-parity"):
        policy_update(
            model,
            sgd(model),
            samples,
            AlgorithmConfig(),
            4,
            monitor_version=2,
            max_logprob_gap=1e-3,
        )
    after = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
    assert torch.equal(before, after)  # the update was not applied
    tokens = sum(len(s.response_tokens) for s in samples)
    expected = 0.06 * len(broken.response_tokens) / tokens
    _, res = params_after(model, samples, AlgorithmConfig(), 4, monitor_version=2)
    assert res.logprob_gap == pytest.approx(expected, abs=1e-5)
    # within the limit the step goes ahead
    _, ok = params_after(
        model, samples, AlgorithmConfig(), 4, monitor_version=2, max_logprob_gap=0.05
    )
    assert ok.grad_norm > 0


def test_fp8_padding_rule():
    assert token_multiple(None, 4, True) == 1
    assert token_multiple("delayed", 1, False) == 16
    assert token_multiple("delayed", 4, False) == 16
    assert token_multiple("delayed", 4, True) == 64  # s / tp per rank must divide by 16
    for tp, sp in ((1, False), (2, True), (4, True), (8, True)):
        multiple = token_multiple("delayed", tp, sp)
        for length in (2, 17, 63, 100):
            padded = -(-length // multiple) * multiple
            assert padded % (16 * (tp if sp else 1)) == 0 and padded >= length


def test_fp8_padding_leaves_loss_and_update_unchanged(model):
    samples = make_samples(model, [[1, -1, -1], [1, 1, -1], [-1, 1, 1]], seed=7)
    algo = AlgorithmConfig()
    adv, keep = advantages_and_keep(samples, algo)
    for mb in make_micro_batches(samples, adv, keep, 4, multiple=16):
        assert mb.tokens.shape[1] % 16 == 0
        assert int(mb.select.sum()) == mb.loss_mask.numel()
    plain, res_plain = params_after(model, samples, algo, 4)
    padded, res_padded = params_after(model, samples, algo, 4, token_multiple=16)
    assert max(len(s.prompt_tokens) + len(s.response_tokens) for s in samples) % 16  # padded
    # float32: other matmul shapes sum in another order (a few ulps); a padding token that
    # leaked into the loss or the attention would move it by far more
    assert res_padded.loss == pytest.approx(res_plain.loss, rel=1e-6)
    assert res_padded.num_tokens == res_plain.num_tokens
    assert torch.allclose(plain, padded, atol=1e-7)


def test_warm_start_drops_examples_longer_than_the_model():
    from megatron_rl.trainer.warm_start import fitting_examples

    examples = [([1] * 10, [2] * 6), ([1] * 10, [2] * 7), ([1] * 20_000, [2]), ([1], [2] * 500)]
    assert fitting_examples(examples, 16) == examples[:1]  # 10 + 6 fits 16 positions exactly
    assert fitting_examples(examples, None) == examples


def _shift_generator(samples, deltas):
    """Make the generator's log-probs ``trainer - delta`` (the ratio trainer / generator is
    exp(delta)), cycling through ``deltas`` over all tokens; the deltas, in token order."""
    used, i = [], 0
    for s in samples:
        shifted = []
        for lp in s.gen_logprobs:
            shifted.append(lp - deltas[i % len(deltas)])
            used.append(deltas[i % len(deltas)])
            i += 1
        s.gen_logprobs = shifted
    return used


@pytest.mark.parametrize("mode", ["none", "icepop"])
def test_step_measures_the_mismatch_and_its_correction(model, mode):
    """The step's mismatch metrics, summed over micro-batches, equal the hand-computed ones
    of the generator log-probs' known shifts: k3 KL = mean(e^d - 1 - d), IcePop masks the
    tokens whose ratio e^d leaves [0.5, 2] and weighs the others by e^d."""
    samples = make_samples(model, [[1, -1], [-1, 1]], seed=3)
    deltas = _shift_generator(samples, [0.9, -0.2, 0.1, -1.0, 0.3])
    algo = AlgorithmConfig(mismatch=mode)
    _, res = params_after(model, samples, algo, 2)  # several micro-batches
    n = len(deltas)
    assert res.num_tokens == n
    kl = sum(math.expm1(d) - d for d in deltas) / n
    assert res.mismatch_kl == pytest.approx(kl, rel=1e-4)
    ratios = [math.exp(d) for d in deltas]
    if mode == "none":
        assert (res.is_weight_mean, res.is_weight_max) == (1.0, 1.0)
        assert res.mismatch_masked_frac == 0.0 and res.mismatch_truncated_frac == 0.0
        return
    kept = [r for r in ratios if 0.5 <= r <= 2.0]
    assert res.mismatch_masked_frac == pytest.approx((n - len(kept)) / n)
    assert res.is_weight_mean == pytest.approx(sum(kept) / n, rel=1e-4)
    assert res.is_weight_max == pytest.approx(max(kept), rel=1e-4)
    assert res.mismatch_truncated_frac == 0.0


def test_step_record_carries_the_mismatch_metrics(model):
    """The metrics record of a step (``loop.step_record``) holds the mismatch keys beside
    ``logprob_gap``, with the step's values."""
    from types import SimpleNamespace

    from megatron_rl.trainer.loop import step_record

    samples = make_samples(model, [[1, -1]], seed=1)
    _shift_generator(samples, [0.5])
    _, res = params_after(model, samples, AlgorithmConfig(mismatch="tis"), 4)
    run = SimpleNamespace(clock=SimpleNamespace(summary=dict), tracker=None)
    pool = SimpleNamespace(version=1, restarts=0)
    record = step_record(run, 1, {"response_tokens": 10}, res, 0.0, 1.0, 2.0, None, pool)
    assert record["logprob_gap"] is res.logprob_gap
    for key in ("mismatch_kl", "is_weight_mean", "is_weight_max", "mismatch_truncated_frac",
                "mismatch_masked_frac"):  # fmt: skip
        assert record[key] == getattr(res, key), key
    assert record["mismatch_kl"] == pytest.approx(math.expm1(0.5) - 0.5, rel=1e-4)
    assert record["is_weight_max"] == pytest.approx(math.exp(0.5), rel=1e-4)  # below C = 2


def test_mismatch_metrics_are_nan_without_a_token_to_train(model):
    """A batch of zero-variance groups has no token with a loss: its mismatch is not
    measured (NaN, as logprob_gap without tokens), not a perfect 0."""
    samples = make_samples(model, [[1, 1], [-1, -1]], seed=2)
    _shift_generator(samples, [0.7])
    _, res = params_after(model, samples, AlgorithmConfig(mismatch="tis"), 4)
    assert res.num_tokens == 0
    for key in ("mismatch_kl", "is_weight_mean", "is_weight_max", "mismatch_truncated_frac",
                "mismatch_masked_frac"):  # fmt: skip
        assert math.isnan(getattr(res, key)), key


def test_the_proximal_log_probs_are_a_recompute_at_no_extra_forward(model, monkeypatch):
    """AReaL's decoupled objective recomputes the proximal policy (the weights the update
    starts from) with an extra forward; an update here is one optimizer step, so the
    loss's own forward is that recompute: the log-probs the correction divides by the
    generator's equal a separate no-grad forward of each sample (make_samples' log-probs,
    taken at the same weights), and the update runs one forward per micro-batch."""
    import megatron_rl.trainer.step as step

    samples = make_samples(model, [[1, -1], [-1, 1]], seed=4)
    recomputed = [lp for s in samples for lp in s.gen_logprobs]
    _shift_generator(samples, [0.4, -0.3])
    seen, forwards = [], []
    original = step.policy_loss

    def recording(kind, logprobs, gen_logprobs, advantages, loss_mask, *args, **kwargs):
        seen.append(logprobs.detach()[loss_mask])
        return original(kind, logprobs, gen_logprobs, advantages, loss_mask, *args, **kwargs)

    monkeypatch.setattr(step, "policy_loss", recording)
    hook = model.module.register_forward_hook(lambda *_: forwards.append(1))
    try:
        policy_update(model, sgd(model), samples, AlgorithmConfig(mismatch="icepop"), 2)
    finally:
        hook.remove()
    # micro-batches take the longest samples first: compare as sorted multisets
    got = torch.sort(torch.cat(seen)).values
    want = torch.sort(torch.tensor(recomputed)).values
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert len(forwards) == len(seen)  # no forward beyond the update's own


def _flat_loss(model, samples, algo, old=True):
    """The policy loss of ``samples`` from log-probs by a separate forward of each sample at
    the model's current weights (``old``: with their stored pi_old), by ``policy_loss``."""
    from megatron_rl.algorithms import policy_loss
    from megatron_rl.algorithms.mismatch import MismatchCorrection
    from megatron_rl.trainer.batch import flat_response_tensors

    adv, keep = advantages_and_keep(samples, algo)
    flat = flat_response_tensors(samples, adv, keep)
    with torch.no_grad():
        lp = torch.cat([
            token_logprobs(model, torch.tensor([s.prompt_tokens + s.response_tokens]))[
                0, len(s.prompt_tokens) - 1 :
            ]
            for s in samples
        ])  # fmt: skip
    # samples not trained (no pi_old) have no token with a loss: any value does
    pi_old = torch.cat([
        torch.tensor(s.gen_logprobs) if s.old_logprobs is None else s.old_logprobs for s in samples
    ])  # fmt: skip
    loss, _ = policy_loss(
        algo.loss, lp, flat["gen"], flat["adv"], flat["mask"], flat["sid"], flat["pid"],
        aggregation=algo.aggregation, mismatch=MismatchCorrection(**algo.mismatch_params()),
        old_logprobs=pi_old if old else None, **algo.loss_params(),
    )  # fmt: skip
    return float(loss)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pack", [False, True])
def test_recompute_stores_pi_old_at_the_rounds_starting_weights(model, pack):
    """mismatch_reference recompute: one no-grad forward over a round's batches (one per
    micro-batch of their trained samples) stores pi_old equal to a separate forward at the
    round's starting weights (make_samples' log-probs, before the generator's are shifted);
    at the round's first step the update equals the ``update`` reference's (same loss, same
    weights after); at its second step, after the weights moved, the update's loss is the
    one with the stored pi_old (ratio pi_theta / pi_old), not the update reference's. Padded
    and packed micro-batches alike."""
    from megatron_rl.trainer.step import recompute_old_logprobs

    algo = AlgorithmConfig(loss="ppo_clip", mismatch="tis", mismatch_reference="recompute")
    # the second batch's second group has no reward variance: not trained, not forwarded
    rounds = [make_samples(model, [[1, -1], [-1, 1]], 6), make_samples(model, [[1, 0], [2, 2]], 7)]
    start = [[list(s.gen_logprobs) for s in b] for b in rounds]
    for batch in rounds:
        _shift_generator(batch, [0.3, -0.2, 0.5])
    forwards = []
    hook = model.module.register_forward_hook(lambda *_: forwards.append(1))
    try:
        assert recompute_old_logprobs(model, rounds, algo, 2, pack=pack) == 2 + 1
    finally:
        hook.remove()
    assert len(forwards) == 3
    for batch, want in zip(rounds, start):
        for sample, lp in zip(batch, want):
            if sample.reward == 2:  # not trained: no pi_old
                assert sample.old_logprobs is None
                continue
            assert torch.allclose(sample.old_logprobs, torch.tensor(lp), atol=1e-5)
    # the round's first step: pi_old is the update's own forward
    update = dataclasses.replace(algo, mismatch_reference="update")
    after_update, res_update = params_after(model, rounds[0], update, 2, pack=pack)
    optimizer = sgd(model)  # params_after's
    res = policy_update(model, optimizer, rounds[0], algo, 2, pack=pack)
    after = torch.cat([p.detach().flatten().clone() for p in model.module.parameters()])
    assert res.loss == pytest.approx(res_update.loss, rel=1e-6)
    assert torch.allclose(after, after_update, atol=1e-6)
    # the second step, at the moved weights: the stored pi_old is the loss's reference
    want, without = _flat_loss(model, rounds[1], algo), _flat_loss(model, rounds[1], algo, False)
    res = policy_update(model, optimizer, rounds[1], algo, 2, pack=pack)
    assert res.loss == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert abs(want - without) > 1e-3 * max(abs(want), 1e-3)  # the reference matters


@pytest.mark.timeout(60)
def test_the_round_is_taken_and_recomputed_before_its_first_step(model):
    """Trainer with mismatch_reference recompute: at a round's first step it takes every batch
    up to the one after which the weights are pushed, holds the rest of the round's prompts
    for a checkpoint's in-flight list and hands the batches out one a step; the round's first
    update recomputes the pi_old of all of them (its ``recompute_seconds``; 0 in the others);
    samples of another version are refused."""
    from types import SimpleNamespace

    from megatron_rl.trainer.loop import Batch, InFlight, Trainer

    algo = AlgorithmConfig(mismatch="tis", mismatch_reference="recompute")
    samples = [make_samples(model, [[1, -1]], seed=i) for i in range(3)]
    for i, batch in enumerate(samples):
        for s in batch:
            s.prompt_id = 10 + i
    queue = [Batch(b, {}, i == 2, 0) for i, b in enumerate(samples)]
    config = SimpleNamespace(
        algorithm=algo,
        batch=SimpleNamespace(micro_batch_size=4, micro_batch_tokens=None, pack=False),
        rollout=SimpleNamespace(temperature=1.0),
    )
    trainer = SimpleNamespace(
        config=config, run=SimpleNamespace(ddp=model), round=[], unrecomputed=[], synced=True,
        in_flight=InFlight(SimpleNamespace(in_flight_prompt_ids=lambda: [5])), token_multiple=1,
        _fetch_batch=lambda: queue.pop(0),
    )  # fmt: skip
    trainer._check_round = lambda batches: Trainer._check_round(trainer, batches)
    first = Trainer._next_round_batch(trainer)
    assert first.samples is samples[0] and not queue
    assert trainer.in_flight.state_dict() == [5, 11, 12]  # a checkpoint regenerates them
    assert all(s.old_logprobs is None for b in samples for s in b)
    Trainer._recompute_round(trainer, first)  # in update(), before the optimizer step
    assert first.info["recompute_seconds"] > 0
    assert all(s.old_logprobs is not None for b in samples for s in b)
    trainer.synced = False  # the round's first update was not pushed
    second = Trainer._next_round_batch(trainer)
    assert second.samples is samples[1] and trainer.in_flight.held == [12]
    Trainer._recompute_round(trainer, second)
    assert second.info["recompute_seconds"] == 0.0
    Trainer._next_round_batch(trainer)
    assert trainer.in_flight.held == [] and trainer.round == []
    trainer.synced = True  # pushed after the round's last update
    stale = make_samples(model, [[1, -1]], seed=9)
    stale[0].versions = [1] * len(stale[0].versions)  # a token of a later version
    queue.append(Batch(stale, {}, True, 0))
    with pytest.raises(RuntimeError, match="not all generated by the trainer's current"):
        Trainer._next_round_batch(trainer)

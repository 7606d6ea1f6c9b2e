"""The train-inference mismatch correction (TIS / MIS / IcePop) and ``algorithm.
mismatch_reference: recompute`` where the trainer runs them: on the GPU (torch and CUDA only,
so tools/gpu_check.sh runs them), against the float64 reference on the CPU.

The correction's test runs on the CPU too (float32 like the trainer's log-probs, the same
reference): the CPU half of what the CUDA run checks. The recompute's logic on the CPU is
test_trainer_step.py's (test_recompute_stores_pi_old_at_the_rounds_starting_weights); here
the same steps run on a CUDA model (megatron's DDP and optimizer, device micro-batches)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.algorithms import MismatchCorrection, compute_loss_normalizers, policy_loss
from megatron_rl.algorithms.config import AlgorithmConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _three_policies(seed: int = 5):
    """Flat ``[T]`` float64 tokens of 12 samples (4 prompts x 3; 2 unmasked prompt tokens and
    1-7 policy tokens each) with three policies: the generator's (``glp``), pi_old (``old``:
    ``glp`` + a mismatch of std 0.5, on both sides of every band) and the current one (``lp``:
    ``old`` + a staleness of std 0.15), advantages, mask, sample and prompt ids."""
    gen = torch.Generator().manual_seed(seed)
    sids, mask = [], []
    for s in range(12):
        n = int(torch.randint(1, 8, (1,), generator=gen))
        sids += [s] * (2 + n)
        mask += [False, False] + [True] * n
    sids, mask = torch.tensor(sids), torch.tensor(mask)
    glp = -torch.rand(len(sids), generator=gen, dtype=torch.float64) * 3 - 0.05
    old = glp + torch.randn(len(sids), generator=gen, dtype=torch.float64) * 0.5
    lp = old + torch.randn(len(sids), generator=gen, dtype=torch.float64) * 0.15
    adv = torch.randn(12, generator=gen, dtype=torch.float64)[sids]
    # float32 as the trainer holds them; the reference takes the same values in float64
    lp, old, glp = (t.float().double() for t in (lp, old, glp))
    return lp, old, glp, adv, mask, sids, sids // 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode, level",
    [("tis", "token"), ("tis", "sequence"), ("mis", "geometric"), ("icepop", "token")],
)
@pytest.mark.parametrize("recompute", [False, True])
def test_corrected_loss_on_the_device_equals_float64_on_the_cpu(device, mode, level, recompute):
    """PPO-clip with a mismatch correction as a trainer step computes it (float32 log-probs on
    the device, the step's normalizers counted on the CPU and moved there, a sequence level
    checking whole samples; ``recompute``: with pi_old): the weights, the truncated / masked
    tokens, the loss, its gradient and the k3 KL equal the float64 CPU computation."""
    from megatron_rl.trainer.step import _normalizers_to

    lp, old, glp, adv, mask, sids, pids = _three_policies()
    correction = MismatchCorrection(mode, level, low=0.8 if level == "geometric" else 0.5)
    ref_norms = compute_loss_normalizers(mask, sids, pids)
    ref_w = correction.weights(old if recompute else lp, glp, mask, sids, ref_norms)
    # the premise: no ratio within float32's reach of a band edge (a flip would be rounding)
    log_ratio = torch.where(mask, (old if recompute else lp) - glp, 0.0)
    if level != "token":
        ids = sids.unique()
        sums = torch.stack([log_ratio[sids == i].sum() for i in ids])
        if level == "geometric":
            sums = sums / torch.stack([mask[sids == i].sum() for i in ids])
        log_ratio = sums[torch.searchsorted(ids, sids)]
    edges = [correction.high] if mode == "tis" else [correction.low, correction.high]
    assert ((log_ratio[mask, None].exp() - torch.tensor(edges)).abs() > 1e-4).all()
    assert ref_w.truncated.any() or ref_w.masked.any()  # the correction acts

    def loss_on(dev, dtype):
        x = lp.to(dev, dtype, copy=True).requires_grad_()
        norms = _normalizers_to(ref_norms, dev)
        loss, stats = policy_loss(
            "ppo_clip", x, glp.to(dev, dtype), adv.to(dev, dtype), mask.to(dev), sids.to(dev),
            pids.to(dev), "token", normalizers=norms, mismatch=correction,
            old_logprobs=old.to(dev, dtype) if recompute else None, eps_low=0.2, eps_high=0.28,
        )  # fmt: skip
        loss.backward()
        return loss, x.grad, stats

    ref_loss, ref_grad, ref_stats = loss_on("cpu", torch.float64)
    got_w = correction.weights(
        (old if recompute else lp).to(device, torch.float32), glp.to(device, torch.float32),
        mask.to(device), sids.to(device), _normalizers_to(ref_norms, device),
    )  # fmt: skip
    assert got_w.weights.device.type == device
    assert torch.allclose(got_w.weights.cpu().double(), ref_w.weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(got_w.truncated.cpu(), ref_w.truncated)
    assert torch.equal(got_w.masked.cpu(), ref_w.masked)
    loss, grad, stats = loss_on(device, torch.float32)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(grad.cpu().double(), ref_grad, rtol=1e-4, atol=1e-7)
    for key in ("mismatch_kl", "is_weight_mean", "truncated_frac", "masked_frac", "clip_frac"):
        assert stats[key].item() == pytest.approx(ref_stats[key].item(), rel=1e-4, abs=1e-7), key


def _sgd(ddp):
    """Megatron's SGD (no momentum, decay or clipping), as test_trainer_step's."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cfg = OptimizerConfig(
        optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    return get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)


def _separate_logprobs(ddp, samples, device) -> list[torch.Tensor]:
    """Each sample's response log-probs by a forward of its own (CPU float32)."""
    from megatron_rl.models.logprobs import token_logprobs

    with torch.no_grad():
        return [
            token_logprobs(ddp, torch.tensor([s.prompt_tokens + s.response_tokens], device=device))[
                0, len(s.prompt_tokens) - 1 :
            ].cpu()
            for s in samples
        ]  # fmt: skip


def _float64_loss(samples, logprobs, algo, with_old=True) -> float:
    """The policy loss of ``samples`` in float64 on the CPU from ``logprobs`` (each sample's,
    by a separate forward) and the samples' stored pi_old."""
    from megatron_rl.trainer.batch import flat_response_tensors
    from megatron_rl.trainer.step import advantages_and_keep

    adv, keep = advantages_and_keep(samples, algo)
    flat = flat_response_tensors(samples, adv, keep)
    lp = torch.cat(logprobs).double()
    old = torch.cat([
        torch.tensor(s.gen_logprobs) if s.old_logprobs is None else s.old_logprobs for s in samples
    ]).double()  # fmt: skip
    loss, _ = policy_loss(
        algo.loss, lp, flat["gen"].double(), flat["adv"].double(), flat["mask"], flat["sid"],
        flat["pid"], aggregation=algo.aggregation,
        mismatch=MismatchCorrection(**algo.mismatch_params()),
        old_logprobs=old if with_old else None, **algo.loss_params(),
    )  # fmt: skip
    return float(loss)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pack", [False, True])
def test_recompute_on_cuda_stores_pi_old_and_the_update_takes_it(megatron_single_rank, pack):
    """mismatch_reference recompute on a CUDA model (megatron's DDP, its SGD; padded and
    packed micro-batches): recompute_old_logprobs stores each trained sample's pi_old on the
    host, equal to a separate forward at the round's starting weights; the round's first
    update equals the ``update`` reference's; the second, at the moved weights, has the loss
    that float64 on the CPU gives with the stored pi_old (and not the one without)."""
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, get_platform
    from megatron_rl.trainer.batch import TrainSample
    from megatron_rl.trainer.optim import wrap_model
    from megatron_rl.trainer.step import policy_update, recompute_old_logprobs

    device = get_platform().torch_device()
    torch.manual_seed(0)
    model = build_model(
        ModelConfig(preset="tiny-llama", dtype="float32", layer_spec="local"), ParallelConfig()
    )
    ddp = wrap_model(model)
    gen = torch.Generator().manual_seed(6)
    rounds = []
    for rewards_by_group in ([[1, -1], [-1, 1]], [[1, 0], [2, 2]]):
        batch = []
        for group, rewards in enumerate(rewards_by_group):
            prompt = torch.randint(
                3, 128, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen
            )
            for r in rewards:
                n = int(torch.randint(2, 9, (1,), generator=gen))
                response = torch.randint(3, 128, (n,), generator=gen).tolist()
                batch.append(
                    TrainSample(group * 10, group, prompt.tolist(), response, [0.0] * n, [True] * n, r, [0] * n)
                )  # fmt: skip
        rounds.append(batch)
    start = [_separate_logprobs(ddp, batch, device) for batch in rounds]
    for batch, logprobs in zip(rounds, start):  # the generator's log-probs: a mismatch
        for i, (sample, lp) in enumerate(zip(batch, logprobs)):
            sample.gen_logprobs = (lp + (0.3, -0.2, 0.5)[i % 3]).tolist()
    algo = AlgorithmConfig(loss="ppo_clip", mismatch="tis", mismatch_reference="recompute")
    assert recompute_old_logprobs(ddp, rounds, algo, 2, pack=pack) == 2 + 1
    for batch, logprobs in zip(rounds, start):
        for sample, lp in zip(batch, logprobs):
            if sample.reward == 2:  # no reward variance: not trained, no pi_old
                assert sample.old_logprobs is None
                continue
            assert sample.old_logprobs.device.type == "cpu"
            assert torch.allclose(sample.old_logprobs, lp, atol=1e-4, rtol=0)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    update = dataclasses.replace(algo, mismatch_reference="update")
    res_update = policy_update(ddp, _sgd(ddp), rounds[0], update, 2, pack=pack)
    after_update = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(before[k])
    optimizer = _sgd(ddp)
    res = policy_update(ddp, optimizer, rounds[0], algo, 2, pack=pack)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert res.loss == pytest.approx(res_update.loss, rel=1e-5)
    assert torch.allclose(after, after_update, atol=1e-5)
    moved = _separate_logprobs(ddp, rounds[1], device)
    want = _float64_loss(rounds[1], moved, algo)
    without = _float64_loss(rounds[1], moved, algo, with_old=False)
    res = policy_update(ddp, optimizer, rounds[1], algo, 2, pack=pack)
    assert res.loss == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert abs(want - without) > 1e-3 * max(abs(want), 1e-3)  # the reference matters

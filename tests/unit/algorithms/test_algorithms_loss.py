"""policy_loss: hand-computed values, float64 autograd references, micro-batch splits."""

import itertools
import math

import pytest
import torch

from megatron_rl.algorithms import (
    AGGREGATIONS,
    LOSSES,
    compute_advantages,
    compute_loss_normalizers,
    policy_loss,
    zero_variance_mask,
)

KINDS = list(LOSSES)
AGGS = list(AGGREGATIONS)
# parameters that give a mix of clipped / truncated and free tokens on the random batch
MIXED_PARAMS = {
    "cispo": {"eps_max": 1.3},
    "ppo_clip": {"eps_low": 0.2, "eps_high": 0.28},
    "gspo": {"eps_low": 0.05, "eps_high": 0.08},
    "reinforce": {},
}


# ---------------------------------------------------------------- hand-computed values
# prompt 0: sample 0 (2 tokens, rho 2 and 0.5, A = 1), sample 1 (1 token, rho 10, A = -1);
# prompt 1: sample 2 (1 token, rho 1, A = 0.5); then one padding token outside the mask.
def _hand_batch(dtype=torch.float64):
    lp = torch.tensor(
        [math.log(0.5), math.log(0.2), math.log(0.1), math.log(0.3), float("-inf")], dtype=dtype
    )
    glp = torch.tensor(
        [math.log(0.25), math.log(0.4), math.log(0.01), math.log(0.3), 0.0], dtype=dtype
    )
    adv = torch.tensor([1.0, 1.0, -1.0, 0.5, float("nan")], dtype=dtype)
    mask = torch.tensor([True, True, True, True, False])
    sids = torch.tensor([0, 0, 1, 2, 3])
    pids = torch.tensor([0, 0, 0, 1, 1])
    return lp.requires_grad_(), glp, adv, mask, sids, pids


@pytest.mark.parametrize(
    ("aggregation", "weights"),
    [
        ("token", [1 / 4, 1 / 4, 1 / 4, 1 / 4]),
        ("prompt", [1 / 6, 1 / 6, 1 / 6, 1 / 2]),  # 2 prompts with 3 and 1 tokens
        ("sample", [1 / 6, 1 / 6, 1 / 3, 1 / 3]),  # 3 samples with 2, 1, 1 tokens
    ],
)
def test_cispo_by_hand(aggregation, weights):
    lp, glp, adv, mask, sids, pids = _hand_batch()
    loss, stats = policy_loss("cispo", lp, glp, adv, mask, sids, pids, aggregation, eps_max=4.0)
    # truncated detached weights: min(rho, 4) = 2, 0.5, 4, 1; A = 1, 1, -1, 0.5
    coef = [2.0, 0.5, -4.0, 0.5]
    logs = [math.log(0.5), math.log(0.2), math.log(0.1), math.log(0.3)]
    assert loss.item() == pytest.approx(-sum(w * c * x for w, c, x in zip(weights, coef, logs)))
    loss.backward()
    expected = [-w * c for w, c in zip(weights, coef)] + [0.0]
    assert lp.grad.tolist() == pytest.approx(expected, abs=1e-12)
    assert stats["rho_mean"].item() == pytest.approx((2 + 0.5 + 10 + 1) / 4)
    assert stats["rho_max"].item() == pytest.approx(10.0)
    assert stats["clip_frac"].item() == pytest.approx(1 / 4)  # rho 10 > eps_max 4
    assert stats["abs_log_ratio_mean"].item() == pytest.approx((2 * math.log(2) + math.log(10)) / 4)
    assert stats["num_tokens"].item() == 4
    assert stats["weight_sum"].item() == pytest.approx(1.0)


def test_ppo_clip_by_hand():
    lp, glp, adv, mask, sids, pids = _hand_batch()
    loss, stats = policy_loss(
        "ppo_clip", lp, glp, adv, mask, sids, pids, "token", eps_low=0.2, eps_high=0.2
    )
    # rho 2, A 1: min(2, 1.2) = 1.2 (clipped); rho 0.5, A 1: min(0.5, 0.8) = 0.5;
    # rho 10, A -1: min(-10, -1.2) = -10; rho 1, A 0.5: 0.5
    assert loss.item() == pytest.approx(-(1.2 + 0.5 - 10 + 0.5) / 4)
    loss.backward()
    # d(rho * A) / d logprob = rho * A on unclipped tokens, 0 on the clipped one
    assert lp.grad.tolist() == pytest.approx([0.0, -0.5 / 4, 10 / 4, -0.5 / 4, 0.0], abs=1e-12)
    assert stats["clip_frac"].item() == pytest.approx(1 / 4)


def test_gspo_by_hand():
    lp, glp, adv, mask, sids, pids = _hand_batch()
    loss, stats = policy_loss(
        "gspo", lp, glp, adv, mask, sids, pids, "token", eps_low=0.2, eps_high=0.2
    )
    # sample 0: log ratios ln 2 and -ln 2 -> s = 1; sample 1: s = 10; sample 2: s = 1
    # objectives per token: 1, 1, min(-10, -1.2) = -10, 0.5
    assert loss.item() == pytest.approx(-(1 + 1 - 10 + 0.5) / 4)
    loss.backward()
    # d s / d logprob_t = s / n_sample: sample 0 -> 2 tokens * (1/4) * A * s / 2 each
    assert lp.grad.tolist() == pytest.approx([-0.25, -0.25, 10 / 4, -0.5 / 4, 0.0], abs=1e-12)
    assert stats["clip_frac"].item() == 0.0


def test_reinforce_by_hand():
    lp, glp, adv, mask, sids, pids = _hand_batch()
    loss, _ = policy_loss("reinforce", lp, glp, adv, mask, sids, pids, "token")
    loss.backward()
    # sg(rho) * A = 2, 0.5, -10, 0.5
    assert lp.grad.tolist() == pytest.approx([-0.5, -0.125, 2.5, -0.125, 0.0], abs=1e-12)


# ---------------------------------------------------------------- random batch + reference
def make_batch(seed=0, dtype=torch.float64):
    """4 prompts x 3 samples of 1..7 tokens with prompt tokens (unmasked) in front; sample 4
    has no policy token; prompt 3 is a zero-variance group (dropped from the loss)."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.tensor([1.0, -1, 1, -1, -1, 1, 1, 1, -1, 1, 1, 1])
    groups = torch.arange(4).repeat_interleave(3)
    keep = zero_variance_mask(rewards, groups)
    sample_adv = compute_advantages(rewards, groups, "batch", keep=keep)
    sids, pids, mask, adv = [], [], [], []
    for s in range(12):
        n_prompt, n_policy = 2, int(torch.randint(1, 8, (1,), generator=gen))
        if s == 4:
            n_policy = 0
        n = n_prompt + n_policy
        sids += [s] * n
        pids += [int(groups[s])] * n
        mask += [False] * n_prompt + [bool(keep[s])] * n_policy
        adv += [float(sample_adv[s])] * n
    num = len(sids)
    glp = -torch.rand(num, generator=gen, dtype=torch.float64) * 3 - 0.05
    lp = glp + torch.randn(num, generator=gen, dtype=torch.float64) * 0.3
    return (
        lp.to(dtype),
        glp.to(dtype),
        torch.tensor(adv, dtype=dtype),
        torch.tensor(mask),
        torch.tensor(sids),
        torch.tensor(pids),
    )


def _min_clip(r, a, low, high):
    return torch.minimum(r * a, torch.clamp(r, 1 - low, 1 + high) * a)


def reference_loss(kind, lp, glp, adv, mask, sids, pids, aggregation, params):
    """The written formulas, token by token, with explicit per-prompt / per-sample means."""
    obj = {}
    for t in range(len(lp)):
        if not mask[t]:
            continue
        if kind == "cispo":
            o = torch.clamp(torch.exp(lp[t] - glp[t]).detach(), max=params["eps_max"])
            o = o * adv[t] * lp[t]
        elif kind == "reinforce":
            o = torch.exp(lp[t] - glp[t]).detach() * adv[t] * lp[t]
        elif kind == "ppo_clip":
            o = _min_clip(torch.exp(lp[t] - glp[t]), adv[t], params["eps_low"], params["eps_high"])
        else:
            same = [u for u in range(len(lp)) if mask[u] and sids[u] == sids[t]]
            s = torch.exp(sum(lp[u] - glp[u] for u in same) / len(same))
            o = _min_clip(s, adv[t], params["eps_low"], params["eps_high"])
        obj[t] = o
    if aggregation == "token":
        return -sum(obj.values()) / len(obj)
    key = sids if aggregation == "sample" else pids
    units = sorted({int(key[t]) for t in obj})
    means = [
        sum(o for t, o in obj.items() if key[t] == u) / sum(1 for t in obj if key[t] == u)
        for u in units
    ]
    return -sum(means) / len(means)


@pytest.mark.parametrize(("kind", "aggregation"), list(itertools.product(KINDS, AGGS)))
def test_gradient_matches_float64_reference(kind, aggregation):
    lp, glp, adv, mask, sids, pids = make_batch(seed=1)
    params = MIXED_PARAMS[kind]
    ref_lp = lp.clone().requires_grad_()
    ref = reference_loss(kind, ref_lp, glp, adv, mask, sids, pids, aggregation, params)
    ref.backward()
    lp64 = lp.clone().requires_grad_()
    loss, stats = policy_loss(kind, lp64, glp, adv, mask, sids, pids, aggregation, **params)
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(lp64.grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    if kind != "reinforce":  # the parameters were chosen to exercise both branches
        assert 0 < stats["clip_frac"].item() < 1
    # float32 inputs give the same gradient to float32 precision
    lp32 = lp.float().requires_grad_()
    loss32, _ = policy_loss(
        kind, lp32, glp.float(), adv.float(), mask, sids, pids, aggregation, **params
    )
    loss32.backward()
    torch.testing.assert_close(lp32.grad.double(), ref_lp.grad, rtol=1e-4, atol=1e-6)


def test_cispo_gradient_flows_through_logprobs_only():
    lp, glp, adv, mask, sids, pids = make_batch(seed=2)
    lp.requires_grad_()
    glp.requires_grad_()
    adv.requires_grad_()
    eps_max = 1.3
    loss, stats = policy_loss("cispo", lp, glp, adv, mask, sids, pids, "token", eps_max=eps_max)
    loss.backward()
    assert glp.grad is None and adv.grad is None
    rho = torch.exp(lp.detach() - glp.detach())
    truncated = mask & (rho > eps_max)
    assert truncated.any() and (mask & ~truncated).any()
    # d loss / d logprob_t = -min(rho_t, eps_max) * A_t / N: rho is a constant weight
    expected = -torch.clamp(rho, max=eps_max) * adv.detach() / mask.sum()
    torch.testing.assert_close(lp.grad, torch.where(mask, expected, 0.0), rtol=1e-12, atol=0)
    assert stats["clip_frac"].item() == pytest.approx(truncated.sum().item() / mask.sum().item())


def test_ppo_clip_has_zero_gradient_where_clipped():
    lp, glp, adv, mask, sids, pids = make_batch(seed=3)
    lp.requires_grad_()
    loss, stats = policy_loss(
        "ppo_clip", lp, glp, adv, mask, sids, pids, "prompt", eps_low=0.2, eps_high=0.28
    )
    loss.backward()
    rho = torch.exp(lp.detach() - glp)
    clipped = mask & (((adv > 0) & (rho > 1.28)) | ((adv < 0) & (rho < 0.8)))
    free = mask & ~clipped & (adv != 0)
    assert clipped.any() and free.any()
    assert torch.all(lp.grad[clipped] == 0)
    assert torch.all(lp.grad[free] != 0)
    assert torch.all(lp.grad[~mask] == 0)
    assert stats["clip_frac"].item() == pytest.approx(clipped.sum().item() / mask.sum().item())


def test_gspo_uses_one_ratio_per_sample():
    lp, glp, adv, mask, sids, pids = make_batch(seed=4)
    lp.requires_grad_()
    loss, _ = policy_loss("gspo", lp, glp, adv, mask, sids, pids, "prompt", eps_low=0.9, eps_high=5)
    loss.backward()
    for s in sids.unique():
        toks = mask & (sids == s)
        if toks.sum() > 1:
            # d s_i / d logprob_t = s_i / n_i, the same for every token of sample i
            grads = lp.grad[toks]
            torch.testing.assert_close(grads, grads[:1].expand_as(grads), rtol=1e-12, atol=0)
            n = toks.sum().item()
            ratio = torch.exp((lp.detach() - glp)[toks].mean())
            # prompt aggregation: each token weighs 1 / (P * n_prompt); n tokens each carry it
            prompt_tokens = (mask & (pids == pids[toks][0])).sum().item()
            num_prompts = len(set(pids[mask].tolist()))
            w = 1 / (num_prompts * prompt_tokens)
            expected = -w * n * adv[toks][0] * ratio / n
            assert grads[0].item() == pytest.approx(expected.item(), rel=1e-10)


def test_zero_variance_group_gets_no_loss():
    lp, glp, adv, mask, sids, pids = make_batch(seed=5)
    dropped = pids == 3  # rewards 1, 1, 1: masked out by the batch builder
    assert torch.all(adv[dropped] == 0) and not mask[dropped].any()
    lp.requires_grad_()
    loss, _ = policy_loss("cispo", lp, glp, adv, mask, sids, pids, "prompt")
    loss.backward()
    assert torch.all(lp.grad[dropped] == 0)
    # same loss as the batch without that group: it does not count as a prompt
    keep = ~dropped
    sub = policy_loss(
        "cispo", lp.detach()[keep], glp[keep], adv[keep], mask[keep], sids[keep], pids[keep]
    )[0]
    assert loss.item() == pytest.approx(sub.item(), rel=1e-12)


# ---------------------------------------------------------------- micro-batches
def _split_points(sids, mask, by_samples):
    """3 uneven micro-batches; by samples (sample boundaries) or at arbitrary tokens."""
    if not by_samples:
        return [0, 5, 29, len(sids)]
    starts = [0] + [t for t in range(1, len(sids)) if sids[t] != sids[t - 1]]
    return [0, starts[2], starts[9], len(sids)]


@pytest.mark.parametrize(("kind", "aggregation"), list(itertools.product(KINDS, AGGS)))
def test_three_uneven_micro_batches_match_one_batch(kind, aggregation):
    lp, glp, adv, mask, sids, pids = make_batch(seed=6, dtype=torch.float32)
    params = MIXED_PARAMS[kind]
    full_lp = lp.clone().requires_grad_()
    full_loss, _ = policy_loss(kind, full_lp, glp, adv, mask, sids, pids, aggregation, **params)
    full_loss.backward()
    norm = compute_loss_normalizers(mask, sids, pids)
    for by_samples in [True] if kind == "gspo" else [True, False]:
        cuts = _split_points(sids, mask, by_samples)
        split_lp = lp.clone().requires_grad_()
        total, weight = 0.0, 0.0
        for a, b in zip(cuts[:-1], cuts[1:]):
            sl = slice(a, b)
            loss, stats = policy_loss(
                kind, split_lp[sl], glp[sl], adv[sl], mask[sl], sids[sl], pids[sl],
                aggregation, normalizers=norm, **params,
            )  # fmt: skip
            loss.backward()
            total += loss.item()
            weight += stats["weight_sum"].item()
        assert len({b - a for a, b in zip(cuts[:-1], cuts[1:])}) == 3  # uneven
        torch.testing.assert_close(split_lp.grad, full_lp.grad, rtol=0, atol=1e-6)
        assert total == pytest.approx(full_loss.item(), abs=1e-6)
        assert weight == pytest.approx(1.0, abs=1e-6)


def test_gspo_rejects_a_sample_split_over_micro_batches():
    lp, glp, adv, mask, sids, pids = make_batch(seed=7)
    norm = compute_loss_normalizers(mask, sids, pids)
    cut = int(torch.nonzero(mask)[1])  # between the first two policy tokens of a sample
    sl = slice(0, cut)
    with pytest.raises(ValueError, match="split the batch by samples"):
        policy_loss("gspo", lp[sl], glp[sl], adv[sl], mask[sl], sids[sl], pids[sl],
                    normalizers=norm)  # fmt: skip


def test_missing_ids_in_normalizers_are_reported():
    lp, glp, adv, mask, sids, pids = make_batch(seed=8)
    norm = compute_loss_normalizers(mask[:10], sids[:10], pids[:10])
    with pytest.raises(ValueError, match="missing from the normalizers"):
        policy_loss("cispo", lp, glp, adv, mask, sids, pids, "sample", normalizers=norm)


def test_normalizer_counts_by_hand():
    mask = torch.tensor([False, True, True, True, False, True, True])
    sids = torch.tensor([0, 0, 0, 1, 2, 2, 5])
    pids = torch.tensor([7, 7, 7, 7, 9, 9, 4])
    norm = compute_loss_normalizers(mask, sids, pids)
    assert norm.sample_keys.tolist() == [0, 1, 2, 5]
    assert norm.sample_tokens.tolist() == [2, 1, 1, 1]
    assert norm.prompt_keys.tolist() == [4, 7, 9] and norm.prompt_tokens.tolist() == [1, 3, 1]
    assert (norm.num_tokens, norm.num_samples, norm.num_prompts) == (5, 4, 3)
    w = norm.token_weights("prompt", mask, sids, pids)
    assert w.tolist() == pytest.approx([0, 1 / 9, 1 / 9, 1 / 9, 0, 1 / 3, 1 / 3])


def test_empty_mask_gives_zero_loss_and_gradient():
    lp, glp, adv, mask, sids, pids = make_batch(seed=9)
    lp.requires_grad_()
    none = torch.zeros_like(mask)
    for kind, agg in itertools.product(KINDS, AGGS):
        loss, stats = policy_loss(kind, lp, glp, adv, none, sids, pids, agg)
        loss.backward()
        assert loss.item() == 0.0 and stats["num_tokens"].item() == 0
        assert torch.all(lp.grad == 0) and not torch.isnan(lp.grad).any()


def test_bad_input_is_reported():
    lp, glp, adv, mask, sids, pids = make_batch(seed=10)
    with pytest.raises(ValueError, match="loss kind"):
        policy_loss("dapo", lp, glp, adv, mask, sids, pids)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss("cispo", lp, glp, adv, mask, sids, pids, "batch")
    with pytest.raises(ValueError, match="eps_max"):
        policy_loss("cispo", lp, glp, adv, mask, sids, pids, eps_max=-1.0)
    with pytest.raises(ValueError, match="eps_low"):
        policy_loss("ppo_clip", lp, glp, adv, mask, sids, pids, eps_low=1.5)
    with pytest.raises(ValueError, match="eps_high"):
        policy_loss("cispo", lp, glp, adv, mask, sids, pids, eps_high=0.2)
    with pytest.raises(ValueError, match="sample_ids"):
        policy_loss("cispo", lp, glp, adv, mask, sids.int(), pids)
    with pytest.raises(ValueError, match="gen_logprobs"):
        policy_loss("cispo", lp, glp[:-1], adv, mask, sids, pids)
    with pytest.raises(ValueError, match="loss_mask"):
        policy_loss("cispo", lp, glp, adv, mask.long(), sids, pids)


def test_gspo_defaults_to_a_sample_average_that_keeps_its_length_normalisation(caplog):
    """GSPO's term is the same for every token of a sample (a length-normalised sequence
    ratio): a prompt average weighs each sample by its length, undoing that normalisation.
    A recipe that leaves algorithm.aggregation unset gets the sample average (the other
    losses keep ScaleRL's prompt average); a recipe that sets prompt with GSPO is warned.
    On-policy, one prompt: sample 0 has 1 token and A = +1, sample 1 has 3 tokens and A = -1;
    by hand the gradient of the loss summed over a sample's tokens is -A_i / 2 under the
    sample average (length-free) and -A_i n_i / 4 under the prompt average."""
    import logging

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.config.loader import from_dict

    assert from_dict(AlgorithmConfig, {"loss": "gspo"}, "algorithm").aggregation == "sample"
    assert from_dict(AlgorithmConfig, {}, "algorithm").aggregation == "prompt"
    assert from_dict(AlgorithmConfig, {"loss": "ppo_clip"}, "algorithm").aggregation == "prompt"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with caplog.at_level(logging.WARNING, logger="megatron_rl.algorithms.config"):
        explicit = from_dict(AlgorithmConfig, {"loss": "gspo", "aggregation": "prompt"})
    assert explicit.aggregation == "prompt"  # honoured, but warned about
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "algorithm.aggregation prompt" in warning and "length" in warning

    lengths, adv_of = [1, 3], [1.0, -1.0]
    sids = torch.tensor([0, 1, 1, 1])
    adv = torch.tensor([adv_of[i] for i in sids.tolist()], dtype=torch.float64)
    glp = torch.log(torch.tensor([0.5, 0.25, 0.4, 0.1], dtype=torch.float64))
    mask, pids = torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.long)
    per_sample = {}
    for aggregation in (AlgorithmConfig(loss="gspo").aggregation, "prompt"):
        lp = glp.clone().requires_grad_(True)
        loss, _ = policy_loss("gspo", lp, glp, adv, mask, sids, pids, aggregation)
        loss.backward()
        per_sample[aggregation] = [lp.grad[sids == i].sum().item() for i in range(2)]
    assert per_sample["sample"] == pytest.approx([-a / 2 for a in adv_of], abs=1e-12)
    weighted = [-a * n / sum(lengths) for a, n in zip(adv_of, lengths)]
    assert per_sample["prompt"] == pytest.approx(weighted, abs=1e-12)

"""Train-inference mismatch correction (TIS / MIS / IcePop) and its k3 KL, against the peers'
formulas transcribed below (float64, the same tensors), and hand-computed values."""

import math
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms import (
    LOSSES,
    MismatchCorrection,
    compute_loss_normalizers,
    mismatch_kl,
    policy_loss,
)
from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.config import ConfigError

# Peers' source the references are transcribed from:
VERL = "volcengine/verl@b178a3cd56f58b2d502255daba591e92833930a7"  # rollout_corr_helper.py
SLIME = "THUDM/slime@624b824a898ab0ec1fcb4d373004c7f3852bf515"
SAFETY_BOUND = 20.0


# ------------------------------------------------------------------ the peers' formulas
def padded(flat, sids, fill=0.0):
    """``[B, L]`` (verl's layout: one row per sample, right-padded) of a flat ``[T]``."""
    rows = [flat[sids == s] for s in torch.unique(sids)]
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), fill, dtype=flat.dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def unpadded(rows, sids):
    """The flat ``[T]`` of ``padded`` rows."""
    out, seen = [], {}
    for s in sids.tolist():
        i = sorted(set(sids.tolist())).index(s)
        seen[i] = seen.get(i, -1) + 1
        out.append(rows[i, seen[i]])
    return torch.stack(out)


def verl_tis_weights(old_log_prob, rollout_log_prob, response_mask, level, threshold):
    """verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_correction_weights`` (commit: VERL above):
    token: exp(clamp(log_ratio, +-20)); sequence: exp(clamp(masked_sum(log_ratio), +-20))
    broadcast; times the response mask; then ``.clamp(max=rollout_is_threshold)``."""
    log_ratio = old_log_prob - rollout_log_prob
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_sum = (log_ratio * response_mask).sum(-1).unsqueeze(-1)
        w = torch.exp(torch.clamp(log_ratio_sum, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    w = w * response_mask
    # verl's rollout_is_ratio_fraction_high (token level): masked mean of w > threshold,
    # taken before the truncation
    high = ((w > threshold).double() * response_mask).sum() / response_mask.sum()
    return w.clamp(max=threshold), high


def verl_k3_kl(old_log_prob, rollout_log_prob, response_mask):
    """rollout_corr_helper.py ``compute_offpolicy_metrics`` (commit: VERL above): ``k3_kl`` =
    masked_mean(exp(log_ratio) - log_ratio - 1), log_ratio = old - rollout."""
    log_ratio = old_log_prob - rollout_log_prob
    k3 = torch.exp(log_ratio) - log_ratio - 1
    return (k3 * response_mask).sum() / response_mask.sum()


def slime_vanilla_tis(train_log_probs, rollout_log_probs, tis_clip, tis_clip_low=0.0):
    """slime/backends/megatron_utils/loss.py ``vanilla_tis_function`` (commit: SLIME above): weights
    clamp(exp(old - rollout), tis_clip_low, tis_clip); tis_clipfrac = weights != tis."""
    tis = torch.exp(train_log_probs - rollout_log_probs)
    w = torch.clamp(tis, min=tis_clip_low, max=tis_clip)
    return w, (w != tis).double()


def slime_icepop(train_log_probs, rollout_log_probs, tis_clip_low, tis_clip):
    """slime/backends/megatron_utils/loss.py ``icepop_function`` (commit: SLIME above): the ratio where
    tis_clip_low <= ratio <= tis_clip, else 0."""
    ratio = torch.exp(train_log_probs - rollout_log_probs)
    w = torch.where((ratio >= tis_clip_low) & (ratio <= tis_clip), ratio, torch.zeros_like(ratio))
    return w, (w != ratio).double()


def slime_mis_mask(train, rollout, loss_mask, level, lower, upper):
    """examples/train_infer_mismatch_helper/mis.py ``compute_mis_weights`` with tis_mode
    mask (commit: SLIME above), one sequence: the log ratio at ``level`` (token; sequence: masked_sum;
    geometric: masked_mean), clamped to +-20, exp; ``mask``: weights * loss_mask and the
    modified mask loss_mask * (lower <= w <= upper). The loss then multiplies pg_loss by the
    weights and sums it under the modified mask: the effective weight is their product."""
    loss_mask = loss_mask.double()
    raw = train - rollout
    if level == "token":
        lr = raw
    elif level == "sequence":
        lr = ((raw * loss_mask).sum()).expand_as(raw)
    else:
        lr = ((raw * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)).expand_as(raw)
    w = torch.exp(torch.clamp(lr, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    in_range = (w >= lower) & (w <= upper)
    return (w * loss_mask) * (loss_mask * in_range.double()), (~in_range).double() * loss_mask


# ------------------------------------------------------------------ against the peers
def _batch(seed=3, spread=0.5):
    """4 prompts x 3 samples of 2 prompt tokens (unmasked) and 1..7 policy tokens, a log
    ratio of std ``spread`` (every band is left on both sides), random advantages."""
    gen = torch.Generator().manual_seed(seed)
    sids, mask = [], []
    for s in range(12):
        n_policy = int(torch.randint(1, 8, (1,), generator=gen))
        sids += [s] * (2 + n_policy)
        mask += [False, False] + [True] * n_policy
    sids, mask = torch.tensor(sids), torch.tensor(mask)
    num = len(sids)
    glp = -torch.rand(num, generator=gen, dtype=torch.float64) * 3 - 0.05
    lp = glp + torch.randn(num, generator=gen, dtype=torch.float64) * spread
    adv = torch.randn(12, generator=gen, dtype=torch.float64)[sids]
    return lp, glp, adv, mask, sids, sids // 3


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_weights_equal_verls(level):
    lp, glp, _, mask, sids, _ = _batch()
    ours = MismatchCorrection("tis", level, high=2.0).weights(lp, glp, mask, sids)
    w, high = verl_tis_weights(
        padded(lp, sids), padded(glp, sids), padded(mask.double(), sids), level, 2.0
    )
    ref = torch.where(mask, unpadded(w, sids), 0.0)
    assert torch.allclose(ours.weights, ref, rtol=1e-13, atol=0)  # up to the sums' order
    assert 0 < ours.truncated.sum() < mask.sum()  # the batch has both
    if level == "token":
        assert ours.truncated.sum().item() / mask.sum().item() == pytest.approx(high.item())


def test_token_tis_and_icepop_equal_slimes():
    lp, glp, _, mask, sids, _ = _batch()
    tis = MismatchCorrection("tis", high=1.5).weights(lp, glp, mask, sids)
    w, clipfrac = slime_vanilla_tis(lp[mask], glp[mask], tis_clip=1.5)
    assert torch.allclose(tis.weights[mask], w, rtol=1e-15, atol=0)
    assert torch.equal(tis.truncated[mask].double(), clipfrac)
    ice = MismatchCorrection("icepop", low=0.5, high=2.0).weights(lp, glp, mask, sids)
    w, clipfrac = slime_icepop(lp[mask], glp[mask], 0.5, 2.0)
    assert torch.allclose(ice.weights[mask], w, rtol=1e-15, atol=0)
    assert torch.equal(ice.masked[mask].double(), clipfrac)
    assert 0 < ice.masked.sum() < mask.sum()
    assert not ice.weights[~mask].any() and not ice.masked[~mask].any()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_weights_equal_slimes_mask_mode(level):
    lp, glp, _, mask, sids, _ = _batch()
    low, high = (0.85, 1.15) if level == "geometric" else (0.5, 2.0)
    ours = MismatchCorrection("mis", level, low=low, high=high).weights(lp, glp, mask, sids)
    for s in torch.unique(sids):
        rows = sids == s
        w, rejected = slime_mis_mask(lp[rows], glp[rows], mask[rows], level, low, high)
        assert torch.allclose(ours.weights[rows], w, rtol=1e-13, atol=0), (level, int(s))
        assert torch.equal(ours.masked[rows].double(), rejected)
    if level != "token":  # every token of a sample shares its weight: whole samples masked
        assert 0 < ours.masked.sum() < mask.sum()


def test_mismatch_kl_equals_verls_k3():
    lp, glp, _, mask, sids, _ = _batch()
    ours = mismatch_kl(lp, glp, mask).sum() / mask.sum()
    ref = verl_k3_kl(padded(lp, sids), padded(glp, sids), padded(mask.double(), sids))
    assert ours.item() == pytest.approx(ref.item(), rel=1e-12)


def test_corrected_loss_and_gradient_equal_slimes_tis_loss():
    """slime's policy_loss_function with --use-tis and no stored recompute (commit: SLIME above):
    old_log_probs = log_probs.detach(); pg_loss = max(-A * ratio, -A * clamp(ratio, 1 - eps,
    1 + eps_high)) with ratio = exp(log_probs - old); pg_loss * tis_weights; token mean."""
    lp, glp, adv, mask, sids, pids = _batch()
    x = lp[mask].clone().requires_grad_()
    old = x.detach()
    ratio = torch.exp(x - old)
    a = adv[mask]
    pg_loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - 0.2, 1 + 0.28))
    w, _ = slime_vanilla_tis(old, glp[mask], tis_clip=2.0)
    ref = (pg_loss * w).sum() / mask.sum()
    ref.backward()
    tis = MismatchCorrection("tis", high=2.0)
    for kind in LOSSES:  # the ratio against the trainer is 1: every loss is w * A * grad log pi
        ours_lp = lp.clone().requires_grad_()
        params = {"ppo_clip": {"eps_low": 0.2, "eps_high": 0.28}}.get(kind, {})
        loss, stats = policy_loss(
            kind, ours_lp, glp, adv, mask, sids, pids, "token", mismatch=tis, **params
        )
        loss.backward()
        if kind in ("ppo_clip", "gspo"):  # the value too (CISPO, REINFORCE: w * A * log pi)
            assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-15), kind
        else:
            value = -(w * a * x.detach()).sum() / mask.sum()
            assert loss.item() == pytest.approx(value.item(), rel=1e-12, abs=1e-15), kind
        expected = x.grad
        if kind == "gspo":  # one ratio per sample: its tokens share the sample's mean gradient
            m = sids[mask]
            expected = torch.stack([x.grad[m == i].mean() for i in m.tolist()])
        assert torch.allclose(ours_lp.grad[mask], expected, rtol=1e-12, atol=1e-15), kind
        assert not ours_lp.grad[~mask].any()
        assert stats["clip_frac"].item() == 0.0  # the loss's own ratio is 1


def test_no_correction_leaves_the_loss_unchanged():
    lp, glp, adv, mask, sids, pids = _batch()
    for kind in LOSSES:
        plain, _ = policy_loss(kind, lp, glp, adv, mask, sids, pids, "prompt")
        none, stats = policy_loss(
            kind, lp, glp, adv, mask, sids, pids, "prompt", mismatch=MismatchCorrection()
        )
        assert none.item() == plain.item()
        assert stats["is_weight_mean"].item() == 1.0 and stats["is_weight_max"].item() == 1.0
        assert stats["truncated_frac"].item() == 0.0 and stats["masked_frac"].item() == 0.0
        assert stats["mismatch_kl"].item() > 0  # measured without a correction too


# ------------------------------------------------------------------ hand-computed values
def _hand(ratios, gen=0.25, sids=None):
    glp = torch.full((len(ratios) + 1,), math.log(gen), dtype=torch.float64)
    lp = glp.clone()
    lp[: len(ratios)] += torch.tensor([math.log(r) for r in ratios], dtype=torch.float64)
    lp[-1] = float("-inf")  # padding outside the mask
    mask = torch.tensor([True] * len(ratios) + [False])
    sids = torch.tensor(sids + [9] if sids else [0] * (len(ratios) + 1))
    return lp, glp, mask, sids


def test_truncated_and_masked_counts_by_hand():
    lp, glp, mask, sids = _hand([3.0, 0.4, 1.1, 0.9, 2.5, 0.6])
    tis = MismatchCorrection("tis", high=2.0).weights(lp, glp, mask, sids)
    assert tis.truncated.tolist() == [True, False, False, False, True, False, False]
    assert tis.weights.tolist() == pytest.approx([2.0, 0.4, 1.1, 0.9, 2.0, 0.6, 0.0])
    ice = MismatchCorrection("icepop").weights(lp, glp, mask, sids)  # band [0.5, 2]
    assert ice.masked.tolist() == [True, True, False, False, True, False, False]
    assert ice.weights.tolist() == pytest.approx([0.0, 0.0, 1.1, 0.9, 0.0, 0.6, 0.0])
    # the stats the trainer sums: 2 of 6 truncated, 3 of 6 masked, weight max 2
    adv, pids = torch.ones(7, dtype=torch.float64), torch.zeros(7, dtype=torch.long)
    for corr, key, frac, mean, top in (
        ("tis", "truncated_frac", 2 / 6, (2 + 0.4 + 1.1 + 0.9 + 2 + 0.6) / 6, 2.0),
        ("icepop", "masked_frac", 3 / 6, (1.1 + 0.9 + 0.6) / 6, 1.1),
    ):
        _, stats = policy_loss(
            "cispo", lp, glp, adv, mask, sids, pids, "token", mismatch=MismatchCorrection(corr)
        )
        assert stats[key].item() == pytest.approx(frac)
        assert stats["is_weight_mean"].item() == pytest.approx(mean)
        assert stats["is_weight_max"].item() == pytest.approx(top)


def test_sequence_levels_by_hand():
    # sample 0: ratios 2 and 1.5 (product 3, geometric sqrt 3); sample 1: 0.8 and 0.5
    # (product 0.4, geometric sqrt 0.4 = 0.632)
    lp, glp, mask, sids = _hand([2.0, 1.5, 0.8, 0.5], sids=[0, 0, 1, 1])
    seq = MismatchCorrection("tis", "sequence", high=2.0).weights(lp, glp, mask, sids)
    assert seq.weights.tolist() == pytest.approx([2.0, 2.0, 0.4, 0.4, 0.0])
    assert seq.truncated.tolist() == [True, True, False, False, False]
    geo = MismatchCorrection("mis", "geometric", low=0.7, high=2.0).weights(lp, glp, mask, sids)
    assert geo.weights.tolist() == pytest.approx([math.sqrt(3)] * 2 + [0.0] * 3)
    assert geo.masked.tolist() == [False, False, True, True, False]


def test_k3_kl_by_hand():
    # r = 2: 2 - 1 - ln 2 = 0.30685; r = 0.5: 0.5 - 1 + ln 2 = 0.19315; r = 1: 0
    lp, glp, mask, _ = _hand([2.0, 0.5, 1.0])
    kl = mismatch_kl(lp, glp, mask)
    assert kl.tolist() == pytest.approx([1 - math.log(2), math.log(2) - 0.5, 0.0, 0.0], abs=1e-15)
    # tiny gaps: k3 ~ (log r)^2 / 2, resolved though float32 log-probs are given
    lp32 = torch.tensor([-1.0 + 1e-3], dtype=torch.float32)
    glp32 = torch.tensor([-1.0], dtype=torch.float32)
    d = float(lp32.double() - glp32.double())
    assert mismatch_kl(lp32, glp32, torch.tensor([True])).item() == pytest.approx(
        math.expm1(d) - d, rel=1e-9
    )


def test_sequence_level_needs_whole_samples_per_micro_batch():
    lp, glp, mask, sids = _hand([2.0, 1.5, 0.8, 0.5], sids=[0, 0, 1, 1])
    norms = compute_loss_normalizers(mask, sids, torch.zeros_like(sids))
    corr = MismatchCorrection("mis", "sequence")
    corr.weights(lp, glp, mask, sids, norms)  # whole: fine
    with pytest.raises(ValueError, match="one micro-batch"):
        corr.weights(lp[:3], glp[:3], mask[:3], sids[:3], norms)


def test_split_micro_batches_sum_to_the_whole_batch():
    lp, glp, adv, mask, sids, pids = _batch()
    norms = compute_loss_normalizers(mask, sids, pids)
    corr = MismatchCorrection("mis", "sequence", low=0.3, high=3.0)
    whole, _ = policy_loss("cispo", lp, glp, adv, mask, sids, pids, "prompt", norms, mismatch=corr)
    cut = int((sids < 6).sum())  # a sample boundary
    parts = [
        policy_loss("cispo", *(x[sl] for x in (lp, glp, adv, mask, sids, pids)), "prompt",
                    norms, mismatch=corr)[0]
        for sl in (slice(0, cut), slice(cut, None))
    ]  # fmt: skip
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)


# ------------------------------------------------------------------ config
@pytest.mark.parametrize(
    ("fields", "key", "match"),
    [
        ({"mismatch": "tls"}, "mismatch", "must be one of"),
        ({"mismatch": "tis", "mismatch_level": "batch"}, "mismatch_level", "must be one of"),
        ({"mismatch": "icepop", "mismatch_level": "sequence"}, "mismatch_level", "token"),
        ({"mismatch": "tis", "mismatch_high": 0.5}, "mismatch_high", ">= 1"),
        ({"mismatch": "mis", "mismatch_high": float("inf")}, "mismatch_high", "finite"),
        ({"mismatch": "mis", "mismatch_low": 1.5}, "mismatch_low", r"\[0, 1\]"),
        ({"mismatch": "mis", "mismatch_low": -0.1}, "mismatch_low", r"\[0, 1\]"),
        ({"mismatch": "tis", "mismatch_low": 0.5}, "mismatch_low", "from above only"),
    ],
)
def test_bad_mismatch_config_names_the_key(fields, key, match):
    with pytest.raises(ConfigError, match=match) as info:
        AlgorithmConfig(**fields).validate()
    assert info.value.key == key


def test_mismatch_params_fill_the_defaults():
    assert AlgorithmConfig().mismatch_params()["mode"] == "none"
    tis = AlgorithmConfig(mismatch="tis", mismatch_high=3.0).mismatch_params()
    assert tis == {"mode": "tis", "level": "token", "low": 0.0, "high": 3.0}
    ice = AlgorithmConfig(mismatch="icepop").mismatch_params()
    assert (ice["low"], ice["high"]) == (0.5, 2.0)
    for mode in ("none", "tis", "mis", "icepop"):
        MismatchCorrection(**AlgorithmConfig(mismatch=mode).mismatch_params())
    with pytest.raises(ValueError, match="mismatch must be one of"):
        MismatchCorrection("bogus")


# ------------------------------------------------ verl's three policies (mismatch_reference)
def verl_vanilla_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c,
    rollout_is_weights=None,
):  # fmt: skip
    """verl/trainer/ppo/core_algos.py ``compute_policy_loss_vanilla`` (commit: VERL above),
    loss_agg_mode token-mean on one batch (``agg_loss``: masked_sum / mask.sum()): ratio =
    exp(clamp(log_prob - old_log_prob, +-20)); pg_losses = max(-A * ratio, -A * clip(ratio,
    1 - low, 1 + high)), dual-clipped at -A * clip_ratio_c for A < 0; times
    rollout_is_weights; pg_clipfrac = masked mean of pg_losses2 > pg_losses1."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = (torch.gt(pg_losses2, pg_losses1).double() * response_mask).sum()
    pg_clipfrac = pg_clipfrac / response_mask.sum()
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    dual = (torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0) * response_mask).sum()
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    loss = (pg_losses * response_mask).sum() / response_mask.sum()
    return loss, pg_clipfrac, dual


def _three_policies(seed=5):
    """``_batch``'s tokens with three policies: the generator's (glp), the trainer's recompute
    at the generator's version (old: glp + a mismatch of std 0.5, both sides of TIS's C = 2)
    and the current one (lp: old + a staleness of std 0.15, both sides of the clip range)."""
    _, glp, adv, mask, sids, pids = _batch(seed)
    gen = torch.Generator().manual_seed(seed + 100)
    old = glp + torch.randn(len(glp), generator=gen, dtype=torch.float64) * 0.5
    lp = old + torch.randn(len(glp), generator=gen, dtype=torch.float64) * 0.15
    return lp, old, glp, adv, mask, sids, pids


@pytest.mark.parametrize("mode,level", [("tis", "token"), ("tis", "sequence"), ("none", "token")])
def test_recomputed_old_logprobs_loss_and_gradient_equal_verls(mode, level):
    """``old_logprobs`` (mismatch_reference recompute): PPO-clip's ratio is pi_theta / pi_old
    and TIS's weight is min(pi_old / pi_gen, C): verl's compute_policy_loss_vanilla with
    old_log_prob = the actor's recompute and rollout_is_weights =
    compute_rollout_correction_weights(old_log_prob, rollout_log_prob) (none: no weights),
    same tensors, float64: loss, gradient and clip fraction."""
    lp, old, glp, adv, mask, sids, pids = _three_policies()
    m = padded(mask.double(), sids)
    x = padded(lp, sids).requires_grad_()
    weights = None
    if mode == "tis":
        weights, _ = verl_tis_weights(padded(old, sids), padded(glp, sids), m, level, 2.0)
    ref, clipfrac, dual = verl_vanilla_policy_loss(
        padded(old, sids), x, padded(adv, sids), m, 0.2, 0.28, 3.0, weights
    )
    ref.backward()
    assert dual == 0  # verl's dual clip (ours has none) does not bind on these tensors
    assert 0 < clipfrac < 1  # the staleness leaves the clip range on some tokens
    ours_lp = lp.clone().requires_grad_()
    loss, stats = policy_loss(
        "ppo_clip", ours_lp, glp, adv, mask, sids, pids, "token",
        mismatch=MismatchCorrection(mode, level, high=2.0), old_logprobs=old,
        eps_low=0.2, eps_high=0.28,
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    grad = torch.where(mask, unpadded(x.grad, sids), 0.0)
    assert torch.allclose(ours_lp.grad, grad, rtol=1e-12, atol=1e-15)
    assert stats["clip_frac"].item() == pytest.approx(clipfrac.item(), rel=1e-6)
    if mode == "tis":  # the mismatch measured is pi_old's, not the current policy's
        k3 = verl_k3_kl(padded(old, sids), padded(glp, sids), m)
        assert stats["mismatch_kl"].item() == pytest.approx(k3.item(), rel=1e-6)
        assert 0 < stats["truncated_frac"].item() < 1


def test_recompute_at_the_update_weights_is_the_update_reference():
    """At a round's first step pi_old is the update's own forward: the loss and its gradient
    equal those of mismatch_reference update (old_logprobs None), for every loss."""
    lp, _, glp, adv, mask, sids, pids = _three_policies()
    for kind in LOSSES:
        got = []
        for old in (None, lp.clone()):
            x = lp.clone().requires_grad_()
            loss, _ = policy_loss(
                kind, x, glp, adv, mask, sids, pids, "prompt",
                mismatch=MismatchCorrection("icepop"), old_logprobs=old,
            )  # fmt: skip
            loss.backward()
            got.append((loss.item(), x.grad))
        assert got[0][0] == got[1][0], kind
        assert torch.equal(got[0][1], got[1][1]), kind


def test_mismatch_reference_config():
    """mismatch_reference: a known name (else the key is named); recompute needs PPO-off-policy
    (PipelineRL's samples span versions: refused at load, naming the key and why)."""
    with pytest.raises(ConfigError, match="must be one of") as info:
        AlgorithmConfig(mismatch_reference="generator").validate()
    assert info.value.key == "mismatch_reference"
    assert AlgorithmConfig(mismatch="tis", mismatch_reference="recompute").recompute
    assert not AlgorithmConfig().recompute


def test_recompute_is_refused_with_pipeline_rl():
    from megatron_rl.config.schema import load_run_config

    recipes = Path(__file__).resolve().parents[3] / "recipes"
    recompute = ["algorithm.mismatch_reference=recompute", "algorithm.mismatch=tis"]
    with pytest.raises(ConfigError, match="spans several policy versions") as info:
        load_run_config(recipes / "tiny_cpu.yaml", recompute, check_model=False)  # PipelineRL-8
    assert info.value.key == "algorithm.mismatch_reference"
    config = load_run_config(recipes / "tiny_cpu_ppo.yaml", recompute, check_model=False)
    assert config.algorithm.recompute and config.off_policy.mode == "ppo"

"""Micro-batch padding in MoE layers (issue 27, 2.4): megatron-core's routers get the
padding mask, so the aux / z losses and the expert-load metrics of a padded batch are those
of the same batch unpadded; under routing replay the padding spreads over the experts
instead of landing on expert 0 in every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_moe_metrics import equal_length_samples

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.models import ModelConfig
from megatron_rl.models.config import MoERouterConfig
from megatron_rl.models.provider import build_model
from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer import routing_replay
from megatron_rl.trainer.optim import wrap_model
from megatron_rl.trainer.step import policy_update

EXPERTS, LAYERS = 4, 4  # tiny-llama4: 4 experts, top-1, MoE on layers 2 and 4 of 4


def update(samples, token_multiple: int, replay: bool = False, capture=None):
    """tiny-llama4 (seeded; routers sharpened so that loads differ) after one SGD (lr 1)
    update with an aux loss and a z-loss: (router weights by layer, the step's result)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe.router import TopKRouter

    torch.manual_seed(0)
    moe = MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=0.05, z_loss_coeff=0.02)
    model = build_model(
        ModelConfig(preset="tiny-llama4", dtype="float32", moe=moe), ParallelConfig()
    )
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    with torch.no_grad():
        for r in routers:
            r.weight.mul_(8.0)
    if replay:
        routing_replay.enable(model)
    ddp = wrap_model(model)
    handles = [r.register_forward_hook(capture) for r in routers] if capture else []
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0)
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    result = policy_update(ddp, opt, samples, AlgorithmConfig(), 4, token_multiple=token_multiple)
    for h in handles:
        h.remove()
    return {r.layer_number: r.weight.detach().clone() for r in routers}, result


def assert_same_load(padded, plain) -> None:
    a, b = padded.expert_load, plain.expert_load
    for name in ("load_balancing_loss", "z_loss"):  # megatron's own, from its tracker
        assert torch.allclose(a.aux_losses[name], b.aux_losses[name], rtol=1e-5), (
            name,
            a.aux_losses[name].tolist(),
            b.aux_losses[name].tolist(),
        )
    assert a.tokens.tolist() == b.tokens.tolist() == [60.0, 60.0]  # 6 x 10 real tokens
    assert a.tokens_per_expert.tolist() == b.tokens_per_expert.tolist()
    assert torch.allclose(a.entropy_sum, b.entropy_sum, rtol=1e-5)


def test_padding_changes_no_router_loss_or_expert_load(megatron_single_rank):
    """6 sequences of 10 tokens, padded to 16 (FP8's multiple: 36 padding tokens per
    micro-batch of 4) or not: the same expert loads, entropy, aux and z losses, and the
    same router update (their gradients), up to float32 summation order. They counted the
    padding: the padding's hidden states shifted the loads, and the losses' means."""
    samples = equal_length_samples(groups=3, per_group=2)
    plain_w, plain = update(samples, token_multiple=1)
    padded_w, padded = update(samples, token_multiple=16)
    assert_same_load(padded, plain)
    assert float(plain.expert_load.load_ratio.max()) > 1.2  # uneven loads: the check has teeth
    for layer in plain_w:
        assert torch.allclose(padded_w[layer], plain_w[layer], atol=1e-6), layer
    assert padded.loss == pytest.approx(plain.loss, rel=1e-6)


def with_routing(samples, seed: int = 1):
    """The samples with generator routing rows [P - 1, layers, top-1] (a sequence's last
    token has none), random experts."""
    gen = np.random.default_rng(seed)
    for s in samples:
        positions = len(s.prompt_tokens) + len(s.response_tokens) - 1
        s.routed_experts = gen.integers(0, EXPERTS, (positions, LAYERS, 1)).astype(np.uint8)
    return samples


def test_replayed_padding_spreads_over_the_experts(megatron_single_rank):
    """Under routing replay the padding positions of a micro-batch go to the experts in turn
    (each expert gets its share, +-1, in every MoE layer); they all went to expert 0, so one
    expert-parallel rank computed all of it. Real tokens replay the generator's experts, and
    the expert loads, which count real tokens only, are those of the unpadded batch."""
    calls = []

    def capture(router, args, output):
        if torch.is_grad_enabled():
            padding = args[1] if len(args) > 1 else None
            calls.append((router.layer_number, output[1].detach().clone(), padding))

    samples = with_routing(equal_length_samples(groups=3, per_group=2))
    _, plain = update(samples, token_multiple=1, replay=True)
    _, padded = update(samples, token_multiple=16, replay=True, capture=capture)
    assert_same_load(padded, plain)
    # replayed: the real tokens' counts are the generator's rows (+ each last token, spread)
    rows = np.concatenate([s.routed_experts for s in samples])
    for i, layer in enumerate(padded.expert_load.layers):
        generator = np.bincount(rows[:, layer - 1, 0], minlength=EXPERTS)
        counts = padded.expert_load.tokens_per_expert[i].numpy()
        assert (counts - generator).min() >= 0 and (counts - generator).sum() == 6
    assert len(calls) == 4  # 2 MoE layers x 2 micro-batches (4 + 2 sequences)
    for layer, routing_map, padding in calls:
        # [s, b] token order; padding True at positions 10..15 of each sequence
        assert padding is not None and padding.shape == (16, routing_map.shape[0] // 16)
        pad = routing_map[padding.reshape(-1)]
        per_expert = pad.sum(dim=0)
        assert int(per_expert.sum()) == pad.shape[0] == 6 * padding.shape[1]
        assert int(per_expert.max() - per_expert.min()) <= 1, (layer, per_expert.tolist())


def test_spread_unrouted_keeps_a_tokens_topk_distinct():
    """Hand-checked: the unrouted choices get experts 0, 1, 2, ... in order; a token's
    top-2 are two consecutive, distinct experts; routed choices are kept."""
    idx = torch.tensor([[3, 1], [-1, -1], [2, 0], [-1, -1], [-1, -1]])
    out = routing_replay.spread_unrouted(idx, num_experts=3)
    assert out.tolist() == [[3, 1], [0, 1], [2, 0], [2, 0], [1, 2]]

"""MoE router settings (recipe keys -> megatron-core's TransformerConfig) and the expert-load
metrics of a policy update, checked against a float64 recomputation from the routers' inputs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.models import ModelConfig
from megatron_rl.models.arch import architecture_from_hf, transformer_config
from megatron_rl.models.provider import build_model, load_hf_config
from megatron_rl.platform import ParallelConfig
from megatron_rl.trainer.batch import TrainSample
from megatron_rl.trainer.optim import wrap_model
from megatron_rl.trainer.step import policy_update

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
TINY_MOE = ["model.preset=tiny-llama4"]


def megatron_config(recipe: Path, overrides: list[str]):
    """The real TransformerConfig (its __post_init__ validation runs) of a recipe."""
    cfg = load_run_config(recipe, overrides)
    arch = architecture_from_hf(load_hf_config(cfg.model))
    return transformer_config(arch, cfg.parallel, torch.float32, True, moe=cfg.model.moe)


def test_router_settings_are_megatron_options():
    keys = [
        "model.moe.load_balancing=seq_aux_loss",
        "model.moe.aux_loss_coeff=0.01",
        "model.moe.z_loss_coeff=1e-3",
        "model.moe.capacity_factor=1.25",
        "model.moe.token_drop_policy=position",
        "model.moe.pad_to_capacity=true",
    ]
    c = megatron_config(RECIPES / "tiny_cpu.yaml", TINY_MOE + keys)
    assert c.moe_router_load_balancing_type == "seq_aux_loss"
    assert c.moe_aux_loss_coeff == 0.01 and c.moe_z_loss_coeff == 1e-3
    assert c.moe_expert_capacity_factor == 1.25 and c.moe_token_drop_policy == "position"
    assert c.moe_pad_expert_input_to_capacity is True
    # Defaults: the router trains as the generator runs it (no balancing loss, dropless).
    d = megatron_config(RECIPES / "tiny_cpu.yaml", TINY_MOE)
    assert d.moe_router_load_balancing_type == "none" and d.moe_aux_loss_coeff == 0.0
    assert d.moe_z_loss_coeff is None and d.moe_expert_capacity_factor is None
    # Scout: Llama-4's aux-loss coefficient, no z-loss, dropless.
    s = megatron_config(RECIPES / "scalerl_scout.yaml", [])
    assert s.moe_router_load_balancing_type == "aux_loss" and s.moe_aux_loss_coeff == 0.001
    assert s.moe_z_loss_coeff is None and s.moe_expert_capacity_factor is None


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model.moe.aux_loss_coeff=-0.1"], "'model.moe.aux_loss_coeff'"),
        (["model.moe.aux_loss_coeff=0.01"], "'model.moe.aux_loss_coeff'"),  # type "none"
        (["model.moe.load_balancing=aux_loss"], "'model.moe.load_balancing'"),  # coeff 0
        (["model.moe.load_balancing=sinkhorn"], "'model.moe.load_balancing'"),
        (["model.moe.z_loss_coeff=0"], "'model.moe.z_loss_coeff'"),
        (["model.moe.capacity_factor=-1"], "'model.moe.capacity_factor'"),
        (["model.moe.capacity_factor=big"], "'model.moe.capacity_factor'"),
        (["model.moe.token_drop_policy=random"], "'model.moe.token_drop_policy'"),
        (["model.moe.pad_to_capacity=true"], "'model.moe.pad_to_capacity'"),
        (["model.moe.capacity_factor=2", "model.preset=tiny-llama"], "'model.moe'"),  # dense
    ],
)
def test_bad_router_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_run_config(RECIPES / "tiny_cpu.yaml", TINY_MOE + overrides)


def equal_length_samples(groups: int, per_group: int, length: int = 6, seed: int = 0):
    """Samples of one length (no micro-batch padding: every routed token is a real one)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(groups):
        prompt = torch.randint(3, 128, (4,), generator=gen).tolist()
        for i in range(per_group):
            response = torch.randint(3, 128, (length,), generator=gen).tolist()
            samples.append(
                TrainSample(
                    g, g, prompt, response, (-torch.rand(length, generator=gen)).tolist(),
                    [True] * length, float(i % 2), [0] * length,
                )
            )  # fmt: skip
    return samples


def recorder(calls: list):
    """A router forward hook appending (layer number, input, weight) of training forwards
    (grad enabled: not the no-grad first pass of a recomputed layer)."""

    def capture(router, args, output):
        if torch.is_grad_enabled():
            calls.append(
                (router.layer_number, args[0].detach().clone(), router.weight.detach().clone())
            )

    return capture


def reference_load(calls, num_experts: int, capacity_factor: float | None):
    """Per MoE layer, in float64 from each router call's input and weight: tokens per expert
    (Llama-4: top-1 of the sigmoid scores), entropy sum of the normalised scores, dropped
    choices (an expert keeps its ``ceil(tokens x topk / experts x factor)`` highest-scored
    tokens)."""
    out = {}
    for layer, hidden, weight in calls:
        logits = hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().t()
        scores = torch.sigmoid(logits)
        counts = torch.bincount(scores.argmax(dim=1), minlength=num_experts).double()
        p = scores / scores.sum(dim=1, keepdim=True)
        entropy = float(-(p * p.log()).sum())
        dropped = 0.0
        if capacity_factor is not None:
            n = logits.shape[0]
            capacity = math.ceil(n / num_experts * capacity_factor)
            if capacity <= n:
                dropped = float((counts - capacity).clamp(min=0).sum())
        c, h, d, t = out.get(layer, (0, 0.0, 0.0, 0))
        out[layer] = (c + counts, h + entropy, d + dropped, t + logits.shape[0])
    return out


@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity0.5"])
def test_expert_load_matches_float64_recomputation(megatron_single_rank, capacity_factor):
    from megatron_rl.models.config import MoERouterConfig

    calls = []
    capture = recorder(calls)

    samples = equal_length_samples(groups=3, per_group=2)  # 6 x 10 tokens
    moe = MoERouterConfig(capacity_factor=capacity_factor)
    _, result = sgd_update(moe, samples, 4, capture)
    load = result.expert_load
    assert load.layers == (2, 4)  # tiny-llama4: MoE on every 2nd layer
    # Hand count: 6 sequences of 4 + 6 tokens, top-1: 60 choices per layer.
    assert load.tokens.tolist() == [60.0, 60.0]
    assert load.tokens_per_expert.sum(dim=1).tolist() == [60.0, 60.0]
    ref = reference_load(calls, 4, capacity_factor)
    assert len(calls) == 4  # 2 layers x 2 micro-batches (4 + 2 sequences)
    for i, layer in enumerate(load.layers):
        counts, entropy, dropped, tokens = ref[layer]
        assert load.tokens_per_expert[i].tolist() == counts.tolist()
        assert float(load.load_ratio[i]) == pytest.approx(float(counts.max() / counts.mean()))
        assert float(load.entropy[i]) == pytest.approx(entropy / tokens, rel=1e-5)
        assert float(load.dropped[i]) == dropped
    assert float(load.load_ratio.max()) > 1.2  # the loads are uneven: the check has teeth
    summary = load.summary()
    if capacity_factor is None:
        assert summary["moe/dropped_fraction"] == 0.0
    else:
        assert 0.0 < summary["moe/dropped_fraction"] < 1.0
    assert 0.0 < summary["moe/router_entropy"] < math.log(4)
    per_layer = load.per_layer()
    assert per_layer["moe/layer_04/tokens_expert_00"] == float(load.tokens_per_expert[1, 0])


def sgd_update(moe, samples, micro_batch_size: int, capture=None):
    """tiny-llama4 (seeded; routers sharpened from the random init's logits ~0.3, so that
    loads differ between experts) after one SGD (lr 1) update with ``moe``:
    (routers' weights by layer, the step's result)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.moe.router import TopKRouter

    torch.manual_seed(0)
    model = build_model(
        ModelConfig(preset="tiny-llama4", dtype="float32", moe=moe), ParallelConfig()
    )
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    with torch.no_grad():
        for r in routers:
            r.weight.mul_(8.0)
    ddp = wrap_model(model)
    handles = [r.register_forward_hook(capture) for r in routers] if capture else []
    cfg = OptimizerConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0)
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    result = policy_update(ddp, opt, samples, AlgorithmConfig(), micro_batch_size)
    for h in handles:
        h.remove()
    return {r.layer_number: r.weight.detach().clone() for r in routers}, result


def test_router_losses_weigh_as_micro_batch_means(megatron_single_rank):
    """With aux_loss_coeff a and z_loss_coeff z the router weights move by the gradient of
    the mean over micro-batches of (a aux + z zloss) more than without (float64
    reference from the routers' inputs), and the logged losses are the micro-batch means."""
    from megatron_rl.models.config import MoERouterConfig

    a, z = 0.05, 0.02
    samples = equal_length_samples(groups=3, per_group=2)
    calls = []
    capture = recorder(calls)

    plain, _ = sgd_update(MoERouterConfig(), samples, 4)
    moe = MoERouterConfig(load_balancing="aux_loss", aux_loss_coeff=a, z_loss_coeff=z)
    with_losses, result = sgd_update(moe, samples, 4, capture)
    assert len(calls) == 4
    micro_batches = len(calls) // 2  # per layer
    grads, aux_means, z_means = {}, {}, {}
    for layer, hidden, weight in calls:
        w = weight.double().requires_grad_(True)
        logits = hidden.reshape(-1, hidden.shape[-1]).double() @ w.t()
        n, experts = logits.shape
        scores = torch.sigmoid(logits)
        p = scores / scores.sum(dim=1, keepdim=True)
        f = torch.bincount(p.argmax(dim=1), minlength=experts).double()  # top-1 counts
        aux = experts / (n * n) * (p.sum(dim=0) * f).sum()  # Switch loss, topk 1
        zloss = (torch.logsumexp(logits, dim=1) ** 2).mean()
        ((a * aux + z * zloss) / micro_batches).backward()
        grads[layer] = grads.get(layer, 0) + w.grad
        aux_means.setdefault(layer, []).append(float(aux.detach()))
        z_means.setdefault(layer, []).append(float(zloss.detach()))
    # The last MoE layer's router: its weight gets only its own losses' gradient (layer 2's
    # also gets layer 4's, through the hidden states in between).
    last = max(grads)
    moved = (with_losses[last] - plain[last]).double()  # SGD lr 1: minus the gradient
    assert float(grads[last].abs().max()) > 1e-3
    assert torch.allclose(moved, -grads[last], rtol=1e-3, atol=1e-6)
    load = result.expert_load
    for i, layer in enumerate(load.layers):
        mean_aux = sum(aux_means[layer]) / len(aux_means[layer])
        mean_z = sum(z_means[layer]) / len(z_means[layer])
        assert float(load.aux_losses["load_balancing_loss"][i]) == pytest.approx(mean_aux, rel=1e-4)
        assert float(load.aux_losses["z_loss"][i]) == pytest.approx(mean_z, rel=1e-4)
    summary = load.summary()
    assert summary["moe/load_balancing_loss"] > 0 and summary["moe/z_loss"] > 0

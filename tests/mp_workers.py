"""Functions run in spawned gloo ranks by the tests (importable by child processes)."""

from __future__ import annotations

import torch


def logits_worker(
    hf_dir: str, tensor: int, expert: int, tokens: torch.Tensor, out_path: str
) -> None:
    """Build the model with the given TP/EP, load HF weights, save full-vocab fp32 logits."""
    import torch.distributed as dist

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.logprobs import forward_logits, gather_vocab
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed

    parallel = ParallelConfig(tensor=tensor, expert=expert)
    init_distributed(parallel)
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), parallel)
    load_hf_weights(model, hf_dir, torch.float32)
    model.eval()
    with torch.no_grad():
        logits = gather_vocab(forward_logits(model, tokens))
    if dist.get_rank() == 0:
        torch.save(logits, out_path)
    destroy_distributed()


def dp_update_worker(samples, out_path: str, world: int, overlap: bool = False) -> None:
    """Build the tiny model (seeded), one SGD policy update over ``samples``; save the params.
    With ``world`` 2 the ranks form a DP=2 group and split the batch by groups; ``overlap``:
    gradients reduced bucket by bucket during the backward (megatron's overlap_grad_reduce)."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.trainer.optim import wrap_model
    from megatron_rl.trainer.step import policy_update

    init_distributed(ParallelConfig(), seed=5)
    model = build_model(ModelConfig(preset="tiny-llama", dtype="float32"), ParallelConfig())
    ddp = wrap_model(model, overlap_grad_reduce=overlap)
    cfg = OptimizerConfig(
        optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    policy_update(ddp, opt, samples, AlgorithmConfig(), 3)
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out_path)
    destroy_distributed()


def layout_update_worker(
    preset: str, layout: dict, samples, out_path: str, replay: bool = False
) -> None:
    """One SGD (lr 1) policy update of ``preset`` (seeded) in a parallel ``layout``; rank 0
    saves the full HF-named weights after it, and the step's statistics. ``replay``: the
    routers replay the samples' ``routed_experts`` (algorithm.routing_replay)."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_rl.algorithms.config import AlgorithmConfig
    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.conversion.weight_stream import iter_hf_weights
    from megatron_rl.models import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.trainer.optim import wrap_model
    from megatron_rl.trainer.step import policy_update

    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=5)
    hf_dir = out_path + ".hf"
    model = build_model(ModelConfig(hf_path=hf_dir, dtype="float32"), parallel)
    load_hf_weights(model, hf_dir, torch.float32)
    replayed = []  # routers that ran with the samples' routing (rank 0)
    if replay:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        from megatron_rl.trainer import routing_replay

        routing_replay.enable(model)
        for layer, router in routing_replay.routers(model):
            router.register_forward_hook(
                lambda m, a, o, layer=layer: (
                    replayed.append(layer)
                    if m.router_replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD
                    else None
                )
            )
    ddp = wrap_model(model)
    cfg = OptimizerConfig(
        optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0
    )
    opt = get_megatron_optimizer(cfg, [ddp], use_gloo_process_groups=False)
    result = policy_update(ddp, opt, samples, AlgorithmConfig(), 2)
    full = {name: t.clone() for bucket in iter_hf_weights(model) for name, t in bucket}
    if dist.get_rank() == 0:
        torch.save({"weights": full, "result": result, "replayed": replayed}, out_path)
    destroy_distributed()

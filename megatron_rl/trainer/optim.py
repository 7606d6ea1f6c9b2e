"""Megatron-Core's data parallelism and optimizer around the policy, and their checkpoints.

The model is wrapped in ``megatron.core.distributed.DistributedDataParallel`` (gradients in
contiguous buffers, reduced over the data-parallel group and, for MoE experts, over the
expert-data-parallel group) and trained by ``get_megatron_optimizer`` (AdamW; gradient-norm
clipping over the model-parallel group; one chained optimizer for dense and expert
parameters). On GPU the optimizer is the distributed (ZeRO-1) optimizer by default; on CPU
it is the plain one, whose inner optimizer is ``torch.optim.AdamW`` (megatron-core falls back
to it without Transformer Engine / Apex), and parameters must be fp32 (megatron's
mixed-precision optimizers check CUDA tensor types).

Loss convention: every micro-batch's loss is already a term of the step's global loss (the
normalisers span the whole batch, all ranks), so gradients are summed over data-parallel
ranks and micro-batches, never averaged: megatron's ``calculate_per_token_loss`` mode, with
the token-count division of ``finalize_model_grads`` left out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_rl.config.sections import OptimizerConfig
from megatron_rl.platform import get_platform

logger = logging.getLogger(__name__)


@dataclass
class Optimizer:
    """The megatron optimizer of a run and its lr / weight-decay scheduler, set by
    ``config``. Its checkpointed state (``state_dict``) is the scheduler's; a resumed run's
    hyperparameters are its own config's (:meth:`load_state_dict`)."""

    optimizer: object  # megatron.core.optimizer.MegatronOptimizer
    scheduler: object  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    config: OptimizerConfig

    def __post_init__(self) -> None:
        # every parameter group's settings as built from ``config`` (megatron's max_lr /
        # min_lr, torch's betas / eps ...): a checkpoint's optimizer state overwrites them
        self.settings = [
            {k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups
        ]

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume the schedule at the checkpoint's step with this run's settings. Call it after
        the optimizer's own state is loaded: that restores every parameter group's settings
        as saved (torch's ``load_state_dict``: megatron's per-group ``max_lr`` / ``min_lr``,
        betas, eps), and megatron's scheduler would keep the saved ``max_lr`` / ``min_lr`` /
        weight decay / warmup (``use_checkpoint_opt_param_scheduler``): a resume with
        ``--allow-changes optimizer.lr=...`` trained on at the old rate. The groups get the
        settings built from ``config`` back, and the scheduler, built to override, takes the
        step alone from ``state``, then sets lr and weight decay."""
        groups = self.optimizer.param_groups
        if len(groups) != len(self.settings):
            raise ValueError(
                f"optimizer: the checkpoint's state has {len(groups)} parameter groups, this "
                f"run's optimizer {len(self.settings)}"
            )
        for group, settings in zip(groups, self.settings):
            group.update(settings)
        self.scheduler.load_state_dict(state)


def _finalize_grads_summed(model_chunks, num_tokens=None, **kwargs) -> None:
    """megatron's ``finalize_model_grads`` (DP / expert-DP reductions, tied embeddings across
    pipeline stages) without dividing by the token count: our losses are normalised already."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads(model_chunks, None, **kwargs)


def wrap_model(
    model, distributed_optimizer: bool | None = None, overlap_grad_reduce: bool | None = None
):
    """``model`` in megatron's DistributedDataParallel, configured for summed RL losses.

    ``distributed_optimizer``: shard optimizer state over data-parallel ranks (default: on
    GPU). ``overlap_grad_reduce``: reduce gradients bucket by bucket during the last
    micro-batch's backward (default: on GPU). Parameters are never gathered asynchronously:
    the weight push reads them right after the optimizer step. Sets the schedule hooks on
    ``model.config``. Returns the wrapper (one model chunk).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    platform = get_platform()
    if distributed_optimizer is None:
        distributed_optimizer = platform.is_gpu
    if overlap_grad_reduce is None:
        overlap_grad_reduce = platform.is_gpu
    if distributed_optimizer and not platform.is_gpu:
        raise ValueError(
            "optimizer.distributed: megatron-core's distributed optimizer needs a GPU "
            "(on CPU it checks CUDA tensor types); leave it unset or false here"
        )
    if not platform.is_gpu:
        wrong = {p.dtype for p in model.parameters() if p.dtype != torch.float32}
        if wrong:
            raise ValueError(
                f"model.dtype: training on CPU needs float32 parameters, got {sorted(map(str, wrong))} "
                "(megatron-core's mixed-precision optimizer is CUDA-only)"
            )
    config = model.config
    config.calculate_per_token_loss = True  # no division by micro-batch count or DP size
    config.variable_seq_lengths = True  # micro-batches are padded to their own longest
    config.finalize_model_grads_func = _finalize_grads_summed
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=distributed_optimizer,
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    # The schedules run every micro-batch but the last under no_sync (gradients accumulate
    # locally); with overlap, the last one's backward launches each bucket's reduction.
    config.no_sync_func = ddp.no_sync if overlap_grad_reduce else None
    return ddp


def build_optimizer(ddp_model, cfg: OptimizerConfig) -> Optimizer:
    """AdamW over ``ddp_model`` with ``cfg``'s schedule: linear warmup to ``cfg.lr``, then
    constant (ScaleRL). Biases and other 1-D parameters get no weight decay (megatron's
    default)."""
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    platform = get_platform()
    lr, wd = cfg.lr, cfg.weight_decay
    dtype = next(ddp_model.parameters()).dtype
    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=lr,
        weight_decay=wd,
        adam_beta1=cfg.betas[0],
        adam_beta2=cfg.betas[1],
        adam_eps=cfg.eps,
        clip_grad=cfg.grad_clip,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=ddp_model.ddp_config.use_distributed_optimizer,
    )
    # On CPU the default process groups are gloo already (no extra gloo groups exist).
    optimizer = get_megatron_optimizer(mcfg, [ddp_model], use_gloo_process_groups=platform.is_gpu)
    # Megatron warms up from init_lr at step 0 to max_lr at step lr_warmup_steps; with
    # init = lr / W over W - 1 steps the update with index s gets lr * (s + 1) / W, exactly
    # OptimizerConfig.lr_factor. A resumed run's schedule is this one at the checkpoint's step
    # (override: megatron's load_state_dict takes the step alone, not the saved settings).
    warmup = max(cfg.warmup_steps, 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=lr / warmup,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=warmup - 1,
        lr_decay_steps=warmup,
        lr_decay_style="constant",
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return Optimizer(optimizer, scheduler, cfg)


# -- checkpoints ---------------------------------------------------------------------------


def save_optimizer(optimizer, model, ckpt_dir: Path, async_save: bool = False):
    """``optimizer``'s state as a megatron dist checkpoint (all ranks call this), sharded like
    the parameters of ``model`` (the unwrapped module), so it loads into another TP / PP / EP /
    DP layout. ``async_save``: return megatron's ``AsyncRequest`` for the caller to schedule
    and finalize (see :func:`megatron_rl.conversion.checkpoint.save_model`), else None."""
    from megatron.core import dist_checkpointing

    from megatron_rl.conversion.checkpoint import use_local_results_queue

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    _materialize_state(optimizer)
    use_local_results_queue(ckpt_dir.parent)  # the checkpoint's .tmp (see save_model)
    state = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=False)
    return dist_checkpointing.save(
        {"optimizer": state}, str(ckpt_dir), async_sharded_save=async_save
    )


def load_optimizer(optimizer, model, ckpt_dir: Path) -> None:
    """Inverse of :func:`save_optimizer`, into this rank's layout."""
    from megatron.core import dist_checkpointing

    from megatron_rl.conversion.checkpoint import with_legacy_keys

    state = optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=True)
    state = with_legacy_keys({"optimizer": state}, ckpt_dir)
    loaded = dist_checkpointing.load(state, str(ckpt_dir))
    _restore_zero_step(loaded["optimizer"])
    optimizer.load_state_dict(loaded["optimizer"])


def _restore_zero_step(tree) -> None:
    """megatron-core 0.16.1 saves the AdamW step shared by all parameters only ``if step:``,
    so the step 0 of a never-stepped optimizer (see :func:`_materialize_state`) comes back
    missing and torch's AdamW refuses the state. Put it back (in every torch optimizer state
    dict of the loaded tree: ``{"state": ..., "param_groups": ...}``)."""
    if not isinstance(tree, dict):
        return
    state = tree.get("state")
    if isinstance(state, dict) and "param_groups" in tree:
        moments = [v for v in state.values() if isinstance(v, dict) and "exp_avg" in v]
        if moments and "common_step" not in state and all("step" not in v for v in moments):
            state["common_step"] = torch.tensor(0.0)
        return
    for value in tree.values():
        _restore_zero_step(value)


def _materialize_state(optimizer) -> None:
    """Give a never-stepped optimizer the state its first step would create.

    torch's AdamW creates its state lazily, so a checkpoint taken before the first step
    (every update so far had no token with loss: all groups zero-variance) would hold no
    moments, and loading it fails on the keys it lacks. Zero moments and ``step`` 0 are
    exactly the lazy initial state, so the resumed run steps as the original would.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner, init = getattr(opt, "optimizer", None), getattr(opt, "init_state_fn", None)
        if inner is None or not callable(init):
            continue
        init(inner, opt.config)  # megatron's: zero exp_avg / exp_avg_sq where state is empty
        if isinstance(inner, (torch.optim.AdamW, torch.optim.Adam)):
            for group in inner.param_groups:
                for p in group["params"]:
                    inner.state[p].setdefault("step", torch.tensor(0.0))

"""One policy update: advantages and filters, log-probs with the FP32 head, loss, optimizer step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.algorithms import (
    compute_advantages,
    compute_loss_normalizers,
    length_penalty,
    policy_loss,
    zero_variance_mask,
)
from megatron_rl.algorithms.config import AlgorithmConfig
from megatron_rl.models.logprobs import forward_logits, logits_to_logprobs
from megatron_rl.platform import collectives, get_platform
from megatron_rl.trainer import routing_replay
from megatron_rl.trainer.balance import assign_groups, imbalance
from megatron_rl.trainer.batch import (
    TrainSample,
    flat_response_tensors,
    is_on_policy,
    make_micro_batches,
    padded_length,
)
from megatron_rl.trainer.moe_aux_loss import (
    check_router_loss_mode,
    has_router_losses,
    scale_router_losses,
)
from megatron_rl.trainer.moe_metrics import ExpertLoad, expert_load_monitor


@dataclass
class StepResult:
    """What one update measured (plain floats, for metrics)."""

    loss: float
    grad_norm: float
    effective_batch_fraction: float
    rho_mean: float
    rho_max: float
    clip_frac: float
    abs_logprob_diff: float
    num_tokens: int
    logprob_gap: float = float("nan")  # mean |trainer - generator| over on-policy tokens
    logprob_gap_tokens: int = 0  # the tokens it is measured on
    expert_load: ExpertLoad | None = None  # MoE models: the step's expert-load statistics
    dp_token_imbalance: float = 1.0  # the busiest data-parallel rank's trained tokens / the mean


class LogprobGapError(RuntimeError):
    """The generator's log-probs of tokens sampled with the trainer's current weights differ
    from the trainer's: the weight path is broken (raised before the optimizer steps)."""


GAP_CAUSES = (
    "likely causes: the generator did not load the pushed weights (a failed or partial push, a "
    "stale packed or tied lm_head in the engine), a different dtype or head precision on the "
    "two sides (model.dtype / model.fp32_head vs rollout.dtype / rollout.fp32_head), a weight "
    "name or layout mapping error in the HF export, or attention settings that differ "
    "(Llama-4 chunking / temperature tuning). Run `megatron-rl check-parity HF_DIR` on the "
    "model; raise training.max_logprob_gap only if the gap is expected (e.g. bf16 kernels)"
)


def shaped_rewards(samples: Sequence[TrainSample], algo: AlgorithmConfig) -> torch.Tensor:
    """``[S]`` rewards, with the length penalty added (``algo.length_penalty_on``: on correct
    samples or on all) when enabled."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    if algo.length_penalty:
        lengths = torch.tensor([len(s.response_tokens) for s in samples])
        on = rewards > 0 if algo.length_penalty_on == "correct" else torch.ones_like(rewards > 0)
        rewards = rewards + length_penalty(
            lengths, on, algo.length_penalty_l_max, algo.length_penalty_l_cache
        )
    return rewards


def advantages_and_keep(samples: Sequence[TrainSample], algo: AlgorithmConfig):
    """``[S]`` advantages and the ``[S]`` kept mask (zero-variance filtering)."""
    rewards = shaped_rewards(samples, algo)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    keep = (
        zero_variance_mask(rewards, groups)
        if algo.zero_variance_filter
        else torch.ones(len(samples), dtype=torch.bool)
    )
    adv = compute_advantages(rewards, groups, normalization=algo.advantage_normalization, keep=keep)
    return adv, keep


def policy_update(
    model,
    optimizer,
    samples: Sequence[TrainSample],
    algo: AlgorithmConfig,
    micro_batch_size: int | None = None,
    temperature: float = 1.0,
    monitor_version: int | None = None,
    max_logprob_gap: float | None = None,
    token_multiple: int = 1,
    micro_batch_tokens: int | None = None,
) -> StepResult:
    """One optimizer step on the step's whole batch (``samples``, the same on every rank).

    ``model`` is the DDP-wrapped policy (``trainer.optim.wrap_model``), ``optimizer`` its
    megatron optimizer. Each data-parallel rank trains whole groups, assigned by their token
    counts (``balance.assign_groups``); advantages and loss normalisers are those of the whole batch,
    gradients are summed over ranks. Pipeline stages run megatron's schedule; the returned
    statistics are global and the same on every rank.

    The log-prob gap is measured on the samples generated entirely by ``monitor_version``
    (the trainer's current weights; None: the trainer is ahead of every sample): above
    ``max_logprob_gap`` :class:`LogprobGapError` is raised before the optimizer steps.
    Micro-batches hold ``micro_batch_size`` sequences or fill a ``micro_batch_tokens`` budget,
    longest sequences first (``batch.plan_micro_batches``); their lengths are padded to a
    ``token_multiple`` (FP8, see ``batch.token_multiple``).

    Samples of zero-variance groups (``algo.zero_variance_filter``) carry no loss: they are
    left out of the forward and backward (often half of a batch; the loss, the gradient and
    the normalisers do not change). Those generated by ``monitor_version`` still count in the
    log-prob gap: they get a forward alone (no backward), before the others.
    """
    from megatron.core import parallel_state

    adv, keep = advantages_and_keep(samples, algo)
    effective = float(keep.float().mean()) if len(samples) else 0.0
    dp_group = parallel_state.get_data_parallel_group()
    size, rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    # Whole groups to ranks by their tokens (trainer/balance.py), the same on every rank.
    kept_all = keep.tolist()
    watched_all = [not k and is_on_policy(s, monitor_version) for s, k in zip(samples, kept_all)]
    lengths = [len(s.prompt_tokens) + len(s.response_tokens) for s in samples]
    owner = assign_groups([s.group for s in samples], lengths, kept_all, watched_all, size)
    loads = [0.0] * size  # trained tokens per rank
    for s, n, k in zip(samples, lengths, kept_all):
        loads[owner[s.group]] += n if k else 0
    mine = [i for i, s in enumerate(samples) if owner[s.group] == rank]
    samples, adv, keep = [samples[i] for i in mine], adv[mine], keep[mine]
    if routing_replay.is_enabled(model):
        routing_replay.require_routing(samples)
    flat = flat_response_tensors(samples, adv, keep, mine)
    # Counted on the CPU: over the gloo twin of the DP group where the default one is NCCL.
    count_group = parallel_state.get_data_parallel_group_gloo() if _is_gpu() else dp_group
    norms = compute_loss_normalizers(
        flat["mask"], flat["sid"], flat["pid"], group=count_group if size > 1 else None
    )
    norms = _normalizers_to(norms, get_platform().torch_device())
    params = algo.loss_params()

    def loss_fn(mb, logits):
        logprobs = logits_to_logprobs(logits, mb.tokens, temperature)[mb.select]
        loss, stats = policy_loss(
            algo.loss,
            logprobs,
            mb.gen_logprobs,
            mb.advantages,
            mb.loss_mask,
            mb.sample_ids,
            mb.prompt_ids,
            aggregation=algo.aggregation,
            normalizers=norms,
            **params,
        )
        n = stats["num_tokens"].float()
        gap = (logprobs.detach().float() - mb.gen_logprobs)[mb.monitor_mask].abs()
        sums = torch.stack(
            [
                loss.detach().float(),
                n,
                stats["rho_mean"].float() * n,
                stats["clip_frac"].float() * n,
                stats["abs_log_ratio_mean"].float() * n,
                gap.sum(),
                torch.tensor(float(gap.numel()), device=gap.device),
            ]
        )
        rho_max = stats["rho_max"].float() if n > 0 else torch.zeros(())
        return loss + 0.0 * logprobs.sum(), sums, rho_max.reshape(1)

    def micro_batches(local: list[int]):  # of these indices into this rank's samples
        return make_micro_batches(
            [samples[i] for i in local],
            adv[local],
            keep[local],
            micro_batch_size,
            ids=[mine[i] for i in local],
            monitor_version=monitor_version,
            multiple=token_multiple,
            micro_batch_tokens=micro_batch_tokens,
        )

    kept = keep.tolist()
    trained = [i for i, k in enumerate(kept) if k]
    watched = [i for i, k in enumerate(kept) if not k and is_on_policy(samples[i], monitor_version)]
    # First the zero-variance samples' log-prob gap: a forward alone (no loss: sums 0-4 are 0).
    with torch.no_grad():
        gap_sums, _ = forward_backward(
            model,
            None,
            micro_batches(watched),
            loss_fn,
            7,
            num_maxes=1,
            token_multiple=token_multiple,
            forward_only=True,
        )
    monitor = expert_load_monitor(model)  # None for a dense model
    with monitor.recording() if monitor else contextlib.nullcontext():
        sums, maxes = forward_backward(
            model,
            optimizer,
            micro_batches(trained),
            loss_fn,
            7,
            num_maxes=1,
            token_multiple=token_multiple,
        )
    expert_load = monitor.reduce() if monitor else None
    sums = sums + gap_sums
    gap_tokens = int(sums[6])
    gap = float(sums[5]) / gap_tokens if gap_tokens else float("nan")
    # The sums are global: every rank raises, or none does.
    if max_logprob_gap is not None and gap_tokens and gap > max_logprob_gap:
        raise LogprobGapError(
            f"trainer vs generator log-prob gap {gap:.3g} (mean over {gap_tokens} tokens "
            f"sampled with the trainer's current weights, policy version {monitor_version}) "
            f"exceeds training.max_logprob_gap {max_logprob_gap:g}; the update was not applied. "
            + GAP_CAUSES
        )
    # A global token count: every rank steps, or none does.
    grad_norm = optimizer.step()[1] if norms.num_tokens else 0.0
    n = max(float(sums[1]), 1.0)
    return StepResult(
        loss=float(sums[0]),
        grad_norm=float(grad_norm or 0.0),
        effective_batch_fraction=effective,
        rho_mean=float(sums[2]) / n,
        rho_max=float(maxes[0]),
        clip_frac=float(sums[3]) / n,
        abs_logprob_diff=float(sums[4]) / n,
        num_tokens=int(sums[1]),
        logprob_gap=gap,
        logprob_gap_tokens=gap_tokens,
        expert_load=expert_load,
        dp_token_imbalance=imbalance(loads),
    )


def forward_backward(
    model,
    optimizer,
    micro_batches: list,
    loss_fn,
    num_sums: int,
    num_maxes: int = 0,
    token_multiple: int = 1,
    forward_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero the gradients, then forward and backward over ``micro_batches`` with megatron's
    schedule (pipelined when PP > 1); gradients end reduced over data-parallel ranks.
    ``forward_only``: the forward alone, gradients untouched (``optimizer`` unused).

    ``loss_fn(mb, logits) -> (loss, sums [num_sums], maxes [num_maxes])`` runs on the last
    pipeline stage; ``loss`` is this micro-batch's term of the global loss. Returns the sums
    summed, and the maxes maxed, over micro-batches and data-parallel ranks, on every rank.
    Data-parallel ranks with fewer micro-batches run empty ones (expert-parallel MoE layers
    exchange tokens inside every forward and backward, so all ranks must run as many).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_attr_wrapped_model

    dp_group = parallel_state.get_data_parallel_group()
    device = get_platform().torch_device()  # where the process groups' backend reduces
    count = collectives.all_reduce(
        torch.tensor([len(micro_batches)]), op=dist.ReduceOp.MAX, group=dp_group
    )
    if int(count) == 0 and forward_only:  # no rank has any: nothing to run
        return torch.zeros(num_sums, dtype=torch.float64), torch.zeros(num_maxes)
    # None: an empty micro-batch (gradients are zeroed and reduced even with nothing to train)
    count = max(int(count), 1)
    batches = list(micro_batches) + [None] * (count - len(micro_batches))
    empty = torch.zeros((1, padded_length(2, token_multiple)), dtype=torch.long)
    router_loss_batches = None  # MoE aux / z losses: weighed as megatron-core means them
    if has_router_losses(get_attr_wrapped_model(model, "config")):
        check_router_loss_mode(model)
        router_loss_batches = int(count) * dist.get_world_size(dp_group)
    replay = routing_replay.is_enabled(model)

    def forward_step(data_iterator, chunk):
        mb = next(data_iterator)
        mb = None if mb is None else mb.to(device)
        if replay:  # the generator's experts (SFT and empty micro-batches route freely)
            routing_replay.set_routing(chunk, getattr(mb, "routing", None))
        padding = getattr(mb, "padding", None)  # routers leave it out of their losses
        output = forward_logits(chunk, (empty if mb is None else mb.tokens).to(device), padding)
        if router_loss_batches is not None:
            output = scale_router_losses(output, router_loss_batches)

        def loss_func(logits):
            if mb is None:
                loss = 0.0 * logits.float().sum()
                sums, maxes = torch.zeros(num_sums), torch.zeros(num_maxes)
            else:
                loss, sums, maxes = loss_fn(mb, logits)
            return loss, torch.tensor(0), {"sums": sums.detach().cpu(), "maxes": maxes.cpu()}

        return output, loss_func

    if not forward_only:
        model.zero_grad_buffer()
        optimizer.zero_grad()
    model.train()
    longest = max((int(mb.tokens.shape[1]) for mb in micro_batches), default=2)
    widest = max((int(mb.tokens.shape[0]) for mb in micro_batches), default=1)
    with routing_replay.replay_session(model):
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[model],
            num_microbatches=len(batches),
            seq_length=longest,
            micro_batch_size=widest,
            forward_only=forward_only,
        )
    sums, maxes = torch.zeros(num_sums, dtype=torch.float64), torch.zeros(max(num_maxes, 1))
    for record in out:  # the last pipeline stage's records; empty elsewhere
        sums += record["sums"].double()
        if num_maxes:
            maxes[:num_maxes] = torch.maximum(maxes[:num_maxes], record["maxes"].float())
    # Sum over DP ranks, then hand the last stage's numbers to every stage (zeros elsewhere).
    sums = collectives.all_reduce(sums, group=dp_group)
    maxes = collectives.all_reduce(maxes, op=dist.ReduceOp.MAX, group=dp_group)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    sums = collectives.all_reduce(sums, group=pp_group)
    maxes = collectives.all_reduce(maxes, op=dist.ReduceOp.MAX, group=pp_group)
    return sums, maxes[:num_maxes]


def _is_gpu() -> bool:
    return get_platform().is_gpu


def _normalizers_to(norms, device):
    tensors = ("sample_keys", "sample_tokens", "prompt_keys", "prompt_tokens")
    return dataclasses.replace(norms, **{k: getattr(norms, k).to(device) for k in tensors})

"""Checks of the generators: every engine starts, takes one push of the trainer's weights and
then generates what the trainer would (the post-push log-prob probe), and how long one
validation pass will take against how long the other ranks wait for it."""

from __future__ import annotations

import math
import time

from megatron_rl.preflight.context import Outcome, PreflightContext

# Decode length of the throughput sample behind the validation estimate (short: the
# preflight's budget; long-context decoding is slower, hence the margin in the limit).
THROUGHPUT_TOKENS = 32


def check_engines(ctx: PreflightContext) -> Outcome:
    """Start the pool (``trainer.loop.start_generators``), push the weights
    (``push_weights``: every rank), probe: trainer vs engine log-probs of samples generated
    right after the push (``trainer.probe.LogprobProbe``) against ``training.max_logprob_gap``
    (FP8 rollouts, ``rollout.quantization``: ``training.max_logprob_gap_fp8``, and first the
    GPU must have FP8: :func:`fp8_engine_problem`)."""
    from megatron_rl.platform import collectives
    from megatron_rl.rollout.weights import m2n_ranks
    from megatron_rl.trainer.batch import token_multiple
    from megatron_rl.trainer.handoff import push_weights
    from megatron_rl.trainer.loop import start_generators
    from megatron_rl.trainer.probe import LogprobProbe

    config, run = ctx.config, ctx.run
    wait = config.rollout.startup_timeout_minutes
    startup = collectives.timed_group(wait)
    error, t0 = None, time.perf_counter()
    with m2n_ranks.serving(run.model, config.rollout):  # nccl_m2n: the source ranks follow
        if ctx.main:
            # FP8 rollouts on a GPU without FP8: decided by the main rank (the one that
            # starts the engines) and agreed on by the broadcast below, like a failed start.
            try:
                fp8_problem = fp8_engine_problem(config)
                if fp8_problem is not None:
                    error = f"recipe key 'rollout.quantization': {fp8_problem}"
                else:
                    ctx.pool = start_generators(run, 0)
            except Exception as err:  # reported as this check's failure, on every rank
                error = f"{type(err).__name__}: {err}"
    error = collectives.broadcast_object(error, group=startup)
    start_seconds = time.perf_counter() - t0
    engines = config.rollout.engines
    if error is not None:
        return Outcome(
            False,
            f"engines failed to start after {start_seconds:.0f} s",
            f"{engines} engines up within rollout.startup_timeout_minutes {wait:g}",
            f"{error}. See the engine logs under the run directory / the generator log; "
            "common causes: vLLM not installed for this GPU, too little free GPU memory "
            "(another process on the engine GPUs), rollout.kv_cache_gb too small for "
            "rollout.max_model_len.",
        )
    push = push_weights(run, ctx.pool)
    push = collectives.broadcast_object(
        None if push is None else (push.bytes, push.seconds, push.gb_per_second)
    )
    quantization = config.rollout.quantization
    limit = config.training.logprob_gap_limit(config.model.dtype, quantization)
    limit_key = config.training.logprob_gap_key(quantization)
    training = config.training
    probe = LogprobProbe(
        run.data.val_ids or run.data.train_ids,
        run.encode,
        every=1,
        samples=training.logprob_probe_samples,
        max_tokens=training.logprob_probe_max_tokens,
        temperature=config.rollout.temperature,
        limit=limit,
        limit_key=limit_key,
        seed=config.seed,
        token_multiple=token_multiple(
            config.model.fp8_scaling, config.parallel.tensor, config.parallel.sequence_parallel
        ),
    )
    result = probe.after_push(run.ddp, ctx.pool, 1, True)
    push_bytes, push_seconds, push_gbps = push
    gap_ok = result.tokens > 0 and (limit is None or result.gap <= limit)
    message = ""
    if not gap_ok:
        from megatron_rl.trainer.step import GAP_CAUSES

        message = (
            f"trainer vs engine log-prob gap {result.gap:.3g} (max {result.max_gap:.3g}, "
            f"{result.tokens} tokens) exceeds {limit_key} {limit}: the engines do "
            "not run the trainer's weights. " + GAP_CAUSES
        )
    return Outcome(
        gap_ok,
        f"{engines} engines up in {start_seconds:.0f} s; push {push_bytes / 1e9:.3g} GB at "
        f"{push_gbps:.3g} GB/s; gap {result.gap:.3g} ({result.tokens} tokens)"
        + (f"; engines run {quantization}" if quantization else ""),
        f"gap <= {limit if limit is not None else 'n/a (training.check_logprob_gap off)'}"
        + (f" ({limit_key})" if limit is not None else ""),
        message,
        {"start_seconds": start_seconds, "push_bytes": push_bytes, "push_seconds": push_seconds,
         "push_gb_per_s": push_gbps, "gap": result.gap, "max_gap": result.max_gap,
         "gap_tokens": result.tokens, "gap_limit": limit, "gap_limit_key": limit_key,
         "quantization": quantization},
    )  # fmt: skip


def fp8_engine_problem(config) -> str | None:
    """Why this machine cannot run the recipe's FP8 rollouts (``rollout.quantization``): its
    GPU (the engines' are of the same kind in a job; ``cluster.gpu`` was checked at load) has
    no FP8, or it has no GPU; None when it can or the rollouts are not FP8."""
    if config.rollout.quantization is None:
        return None
    from megatron_rl.config.checks import rollout_quantization_problem
    from megatron_rl.platform.inventory import device_inventory

    inv = device_inventory()
    if inv.capability is None:
        where = "this machine (CPU only)"
    else:
        where = f"{inv.device_name} (compute capability {inv.capability[0]}.{inv.capability[1]})"
    return rollout_quantization_problem(config, where, inv.capability)


def validation_estimate(
    sequences: int,
    capacity: int,
    response_tokens: int,
    step_seconds: float,
    prefill_seconds: float = 0.0,
) -> float:
    """Seconds of a validation pass of ``sequences`` when the engines decode ``capacity`` at
    a time (waves), each wave's prompts prefilled in ``prefill_seconds`` (with its first
    token), then decoded to ``response_tokens`` at ``step_seconds`` per decode step of a full
    batch (every sample taken to its longest: an upper bound in tokens; decoding at long
    context is slower than the short sample measured: a lower bound per step)."""
    waves = math.ceil(sequences / max(capacity, 1))
    return waves * (prefill_seconds + max(response_tokens - 1, 0) * step_seconds)


def _decode_speed(ctx: PreflightContext, ids: list[int], spp: int, capacity: int) -> dict:
    """(prefill seconds, seconds per decode step) of one full wave of validation prompts:
    the same number of prompts generated to :data:`THROUGHPUT_TOKENS` and to 1 token (other
    prompts, so that the prefix cache does not hide the second prefill), main rank only."""
    config, run = ctx.config, ctx.run
    n = max(1, min(len(ids), capacity // spp))
    long_ids, short_ids = ids[:n], (ids[n : 2 * n] if len(ids) >= 2 * n else ids[:n])
    tokens = min(THROUGHPUT_TOKENS, config.rollout.max_tokens)
    cfg = config.validation
    temperature = cfg.temperature if cfg.temperature is not None else config.rollout.temperature

    def timed(prompts: list[int], max_tokens: int) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = ctx.pool.generate(
            [run.encode(i) for i in prompts],
            samples_per_prompt=spp,
            max_tokens=max_tokens,
            temperature=temperature,
            seeds=[config.seed + i for i in prompts],
        )
        return time.perf_counter() - t0, out

    long_seconds, samples = timed(long_ids, tokens)
    short_seconds, _ = timed(short_ids, 1)
    steps = max((len(s.response_ids) for s in samples), default=0)
    waves = math.ceil(len(samples) / max(capacity, 1))  # a batch larger than the engines hold
    return {
        "measured_sequences": len(samples),
        "measured_tokens": sum(len(s.response_ids) for s in samples),
        "measured_seconds": long_seconds,
        "prefill_seconds": short_seconds / waves,
        "step_seconds": max(long_seconds - short_seconds, 0.0) / max(steps - 1, 1) / waves,
    }


def check_validation(ctx: PreflightContext) -> Outcome:
    """Decode a full batch of validation prompts (as many sequences as the engines hold at
    once, :data:`THROUGHPUT_TOKENS` long), extrapolate one validation pass, compare with
    ``validation.timeout_minutes``: the other ranks wait that long for rank 0's validation
    pass (``trainer.handoff.rank_zero_waits``), not ``parallel.timeout_minutes``."""
    from megatron_rl.platform import collectives

    config, run = ctx.config, ctx.run
    cfg = config.validation
    timeout = cfg.timeout_minutes * 60
    limit = f"< validation.timeout_minutes {cfg.timeout_minutes:g} min"
    if not cfg.enabled:
        return Outcome(True, "validation off", limit)
    estimate = None
    if ctx.main:
        ids = [i for ids in run.data.val_by_domain().values() for i in ids[: cfg.num_prompts]]
        sequences = len(ids) * cfg.samples_per_prompt
        capacity = config.rollout.engines * config.rollout.max_num_seqs
        speed = _decode_speed(ctx, ids, cfg.samples_per_prompt, capacity)
        longest = config.max_response_tokens()
        seconds = validation_estimate(
            sequences, capacity, longest, speed["step_seconds"], speed["prefill_seconds"]
        )
        estimate = {
            "seconds": seconds,
            "sequences": sequences,
            "capacity": capacity,
            "response_tokens": longest,
            **speed,
        }
    estimate = collectives.broadcast_object(estimate)
    ok = estimate["seconds"] < timeout
    return Outcome(
        ok,
        f"~{estimate['seconds']:.0f} s for {estimate['sequences']} samples of up to "
        f"{estimate['response_tokens']} tokens ({estimate['step_seconds'] * 1e3:.3g} ms per "
        f"decode step of {min(estimate['capacity'], estimate['sequences'])} sequences)",
        limit,
        "" if ok else (
            "one validation pass may outlast validation.timeout_minutes, how long the other "
            "trainer ranks wait for it: raise validation.timeout_minutes above it, or lower "
            "validation.num_prompts / validation.samples_per_prompt"
        ),
        estimate,
    )  # fmt: skip

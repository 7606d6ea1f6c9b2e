"""The RL training loop (ScaleRL): generate, reward, filter, update, push weights in flight."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron_rl.config.schema import RunConfig
from megatron_rl.platform import collectives, get_platform, watchdog
from megatron_rl.rollout.client import WeightsNeeded
from megatron_rl.scaling.forecast import resolve_budget
from megatron_rl.trainer import hf_export
from megatron_rl.trainer.batch import TrainSample, token_multiple
from megatron_rl.trainer.compute import generation_share
from megatron_rl.trainer.probe import LogprobProbe
from megatron_rl.trainer.rollout_source import (
    DynamicSampling,
    Group,
    PromptsExhausted,
    RolloutSource,
    token_lag_histogram,
)
from megatron_rl.trainer.setup import Run, build_run
from megatron_rl.trainer.step import policy_update

logger = logging.getLogger(__name__)


def train(
    config: RunConfig, run_dir: Path, restart: bool = False, allow_changes: bool = False
) -> int:
    """Run (or resume) the recipe in ``run_dir`` on every trainer rank. Returns an exit code.

    The main rank (global rank 0) owns the generator pool, the rollout source, rewards,
    validation and metrics; each step it broadcasts the scored batch to all ranks, which
    update together (TP inside the model, DP by groups) and push weights collectively.
    """
    run = build_run(config, Path(run_dir), restart, allow_changes)  # claims run_dir: rundir.py
    step, carry = resume_or_warm_start(run)
    run.step = step
    main = _is_main()
    # Engines can take many minutes to load (Scout); the other ranks wait meanwhile on a gloo
    # group whose timeout is the start-up's, not in a collective with the world's timeout.
    wait = config.rollout.startup_timeout_minutes
    startup = collectives.timed_group(wait)
    pool = start_generators(run, step) if main else None
    collectives.barrier(startup, wait, timeout_key="rollout.startup_timeout_minutes")
    run.waits = rank_zero_waits(config)
    push_weights(run, pool)  # warm-started or resumed weights
    run.forecast = start_forecast(run) if main else None
    source = None
    if main:
        source = RolloutSource(
            pool,
            run.sampler.next_prompts,
            run.encode,
            config.batch.prompts_per_step,
            config.batch.samples_per_prompt,
            config.off_policy.mode,
            _lag(config),
            seed_of=lambda prompt_id: _sampling_seed(config.seed, prompt_id, run.step),
            shuffle_seed=config.seed,
            dynamic=dynamic_sampling(run),
            capacity=config.rollout.engines * config.rollout.max_num_seqs,
            fill=config.off_policy.pool_fill,
        )
        source.submit(carry)  # prompts in flight at the last checkpoint are regenerated
    # The trainer's weights are those of the generator's current policy version right after
    # a push; an update without a push (PPO-off-policy-k) puts the trainer ahead of every
    # sample, and the log-prob gap monitor then has nothing exact to compare.
    synced = True
    gap_limit = config.training.logprob_gap_limit(config.model.dtype)
    multiple = token_multiple(
        config.model.fp8_scaling, config.parallel.tensor, config.parallel.sequence_parallel
    )
    # The monitor above sees only the first PipelineRL batch: probe pushes as well.
    probe = LogprobProbe.from_run(run, step, multiple)
    stop = _StopFlag(config.checkpoint.on_signals)
    if step == 0 and config.validation.enabled and config.validation.at_start:
        validate(run, pool, step, main)
    run.clock.begin("train")  # the x axis: from here on, but for validation and checkpoints
    finished = False
    bar = tqdm(
        total=config.training.max_steps,
        initial=step,
        desc="train",
        disable=not (main and config.logging.progress_bar),
    )
    # a rank stuck outside a collective exits with a stack dump: a requeue, not a lost day
    watchdog.arm(config.training.hang_timeout_minutes, run.run_dir, _rank())
    try:
        while step < config.training.max_steps:
            watchdog.beat(f"step {step + 1}: batch")
            t0 = time.perf_counter()
            batch = on_every_rank(run, pool, main, lambda: next_batch(run, source, pool))
            if batch is None:  # every prompt retired, or the GPU-hour budget spent
                break
            samples, info, wants_push = batch
            info["lr"] = run.optim.lr  # the rate of this update (the scheduler moves on after)
            t1 = time.perf_counter()
            watchdog.beat(f"step {step + 1}: update")
            # PipelineRL: the main rank's feeder keeps the engines topped up during the update
            with source.feeding() if main else contextlib.nullcontext():
                result = policy_update(
                    run.ddp,
                    run.optim.optimizer,
                    samples,
                    config.algorithm,
                    config.batch.micro_batch_size,
                    micro_batch_tokens=config.batch.micro_batch_tokens,
                    temperature=config.rollout.temperature,
                    monitor_version=info["generator_version"] if synced else None,
                    max_logprob_gap=gap_limit,
                    token_multiple=multiple,
                )
            synced = wants_push
            run.optim.scheduler.step(increment=1)
            step = run.step = step + 1
            t2 = time.perf_counter()
            watchdog.beat(f"step {step}: push")
            # ... and during the push (requests in flight keep decoding; see push_weights)
            feed = source.feed if main else None
            push = push_weights(run, pool, between=feed) if wants_push else None
            probed = probe.after_push(
                run.ddp, pool, step, wants_push, lambda make: on_every_rank(run, pool, main, make)
            )
            if main:
                record = step_record(run, step, info, result, t0, t1, t2, push, pool)
                record.update(source.generator_load())  # over this step
                run.metrics.log({**record, **(probed.metrics() if probed else {})})
                if result.expert_load is not None:
                    run.metrics.log_tensorboard(step, result.expert_load.per_layer())
            probe.check(probed)  # on every rank, after the record: the failing gap is logged
            if main:
                bar.update(1)
                bar.set_postfix(reward=f"{info['reward_mean']:.2f}", lag=info["staleness_max"])
                if run.forecast is not None:
                    run.forecast.poll({"step": step, **run.clock.summary()})
                if run.exporter is not None:
                    run.exporter.poll()
            watchdog.beat(f"step {step}: validation and checkpoint")
            if config.validation.enabled and step % config.validation.every_steps == 0:
                validate(run, pool, step, main)
            with run.clock.window("checkpoint"):
                run.checkpoints.finalize()  # an async save whose write is done completes
            # only some ranks may have got the signal
            signalled = collectives.any_rank(stop.requested is not None)
            if _due(step, config.checkpoint.every_steps) or signalled:
                save_checkpoint(run, step, source, wait=signalled)
            if signalled:
                signal_name = stop.requested or "a signal to another rank"
                logger.info("stopping on %s after checkpointing step %d", signal_name, step)
                return 0
        validated_at_end = config.validation.enabled and step % config.validation.every_steps != 0
        if validated_at_end:
            validate(run, pool, step, main)
        # The loop's own checkpoint of this step holds everything unless validation ran since.
        saved = step > 0 and _due(step, config.checkpoint.every_steps) and not validated_at_end
        if config.checkpoint.save_at_end and not saved:
            save_checkpoint(run, step, source, wait=True)
        with run.clock.window("checkpoint"):
            run.checkpoints.finalize(blocking=True)
        finished = True
    finally:
        watchdog.disarm()
        run.checkpoints.abandon()  # an error's path: no collective (a normal end finalized)
        run.clock.begin("shutdown")
        bar.close()
        if pool is not None:
            pool.close()
        run.rewards.close()
        if run.exporter is not None:  # a stop on a signal does not wait for an export
            run.exporter.close(hf_export.FINAL_WAIT_SECONDS if finished else 0.0)
        if main:
            finish_metrics(run, step, finished)
        run.metrics.close()
    if main:
        _plot(run)
    return 0


REWEIGH = "reweigh"  # the main rank's answer instead of a value: restarted engines wait


@dataclass(frozen=True)
class RankZeroWaits:
    """The other ranks' waits on the main rank's long work, each on a gloo group bounded by
    its own setting instead of ``parallel.timeout_minutes`` (which a validation pass at
    paper scale outlasts by hours)."""

    batch: collectives.RankZeroWait  # a batch or a probe: rollout.batch_timeout_minutes
    validation: collectives.RankZeroWait  # a validation pass: validation.timeout_minutes


def rank_zero_waits(config: RunConfig) -> RankZeroWaits:
    """Every rank calls this at the same point (it makes gloo groups)."""
    return RankZeroWaits(
        collectives.RankZeroWait(
            config.rollout.batch_timeout_minutes, "rollout.batch_timeout_minutes"
        ),
        collectives.RankZeroWait(config.validation.timeout_minutes, "validation.timeout_minutes"),
    )


def on_every_rank(
    run: Run,
    pool,
    main: bool,
    make: Callable[[], Any],
    share: bool = True,
    validation: bool = False,
) -> Any:
    """``make()`` on the main rank (it drives the pool), broadcast to every rank (``share``;
    else it stays on the main rank and the others get None). While the main rank waits on
    the pool, restarted engines may wait for the current weights (elastic engines,
    ``WeightsNeeded``): then every rank streams the weights again into those engines (a
    collective, like a push), and ``make`` is called again (it resumes). The other ranks
    wait under ``run.waits`` (``validation``: a validation pass's bound, else a batch's)."""
    waits = getattr(run, "waits", None)
    wait = (waits.validation if validation else waits.batch) if waits is not None else None
    broadcast = wait.broadcast_object if wait is not None else collectives.broadcast_object
    while True:
        value = _or_reweigh(make, pool) if main else None
        # The other ranks wait here for the main rank's long work (a batch, validation), under
        # its own bound (run.waits); the main rank is judged meanwhile (its waits on the pool
        # beat), and so is its wait here for another rank that stopped.
        waiting = (
            watchdog.paused("waiting for the main rank") if not main else contextlib.nullcontext()
        )
        with waiting:
            sent = broadcast(value if share or _is_reweigh(value) else None)
        if not _is_reweigh(sent):
            return value if main else sent
        push_weights(run, pool, reweigh=True)


def _is_reweigh(value: Any) -> bool:
    return isinstance(value, str) and value == REWEIGH


def _or_reweigh(make: Callable[[], Any], pool) -> Any:
    try:
        return make()
    except WeightsNeeded:
        logger.info("re-sending the weights of version %d to restarted engines", pool.version)
        return REWEIGH


def next_batch(run: Run, source: RolloutSource, pool):
    """(samples, info, wants_push) of the next step, or None when training must end (main
    rank only); raises ``WeightsNeeded`` (see :func:`on_every_rank`)."""
    if _budget_spent(run):
        logger.info("GPU-hour budget spent: stopping at step %d", run.step)
        return None
    try:
        groups = source.next_batch(pool.version)
    except PromptsExhausted:
        logger.info("every training prompt is retired: stopping at step %d", run.step)
        return None
    samples, info = score_groups(run, groups, pool.version)
    info["staleness_hist"] = token_lag_histogram(groups, pool.version, _lag(run.config))
    info["generator_version"] = pool.version  # of the weights the generator holds now
    info.update(source.counts)  # prompts drawn this step; dynamic sampling's kept / dropped
    return samples, info, source.wants_push()


def dynamic_sampling(run: Run) -> DynamicSampling | None:
    """The rollout source's dynamic sampling (``data.dynamic_sampling``), else None."""
    data = run.config.data
    if not data.dynamic_sampling:
        return None
    return DynamicSampling(
        score=lambda groups: reward_groups(run, groups),
        discard=lambda groups: record_pass_rates(run, groups),
        max_rounds=data.dynamic_sampling_max_rounds,
    )


def reward_groups(run: Run, groups: list[Group]) -> None:
    """Score the samples of every group not scored yet (sets ``rewards``, ``reward_timeouts``)."""
    todo = [g for g in groups if g.rewards is None]
    flat = [(g, s) for g in todo for s in g.samples]
    if not flat:
        return
    texts = [run.tokenizer.decode(s.response_ids, skip_special_tokens=True) for _, s in flat]
    prompts = [run.data.get(g.prompt_id) for g, _ in flat]
    rewards = run.rewards.score_batch(
        texts, [p.reference for p in prompts], [p.kind for p in prompts]
    )
    statuses = list(run.rewards.last_statuses)
    start = 0
    for g in todo:
        end = start + len(g.samples)
        g.rewards = [float(r) for r in rewards[start:end]]
        g.reward_timeouts = statuses[start:end].count("timeout")
        start = end


def record_pass_rates(run: Run, groups: list[Group]) -> None:
    """No-Positive-Resampling history: the scored groups' rewards, trained on or dropped."""
    if run.tracker is not None:
        ids = [g.prompt_id for g in groups for _ in g.rewards]
        run.tracker.update(ids, [r for g in groups for r in g.rewards])


def score_groups(run: Run, groups: list[Group], version: int) -> tuple[list[TrainSample], dict]:
    """Rewards for every sample, pass-rate history (No-Positive-Resampling), batch stats."""
    reward_groups(run, groups)  # those that dynamic sampling has not scored already
    record_pass_rates(run, groups)
    flat = [(g, i, s, r) for i, g in enumerate(groups) for s, r in zip(g.samples, g.rewards)]
    prompts = [run.data.get(g.prompt_id) for g, _, _, _ in flat]
    rewards = [r for _, _, _, r in flat]
    samples = [
        TrainSample(
            prompt_id=g.prompt_id,
            group=i,
            prompt_tokens=list(s.prompt_ids),
            response_tokens=list(s.response_ids),
            gen_logprobs=list(s.logprobs),
            policy_mask=list(s.mask),
            reward=r,
            versions=list(s.versions),
            truncated=s.finish_reason == "length",
            interrupted=s.interrupted,
            routed_experts=s.routed_experts,
        )
        for g, i, s, r in flat
    ]
    lags = [version - min(s.versions) for s in samples if s.versions]
    n = max(len(samples), 1)
    info = {
        "reward_mean": sum(s.reward for s in samples) / n,
        "pass_rate": sum(s.reward > 0 for s in samples) / n,
        "truncation_rate": sum(s.truncated for s in samples) / n,
        "interruption_rate": sum(s.interrupted for s in samples) / n,
        "response_tokens": sum(len(s.response_tokens) for s in samples),
        "staleness_mean": sum(lags) / max(len(lags), 1),
        "staleness_max": max(lags, default=0),
        "samples": len(samples),
        # Verifications that ran out of time score incorrect; counted so they never pass
        # for wrong answers unseen.
        "reward_timeouts": sum(g.reward_timeouts for g in groups),
        "prompt_ids": [g.prompt_id for g in groups],
        "group_pass_rates": [
            sum(s.reward > 0 for s in samples if s.group == i) / max(len(g.samples), 1)
            for i, g in enumerate(groups)
        ],
    }
    if len(run.data.sources) > 1:  # a mixture: the training reward of each domain too
        info.update(_by_domain("reward_mean", [p.kind for p in prompts], rewards, mean=True))
    return samples, info


def _by_domain(key: str, domains: list[str], rewards: list[float], mean: bool) -> dict:
    """``{key/<domain>: mean reward (mean) or pass rate}`` over the items of each domain."""
    out = {}
    for domain in dict.fromkeys(domains):
        values = [r for d, r in zip(domains, rewards) if d == domain]
        out[f"{key}/{domain}"] = (
            sum(values) / len(values) if mean else sum(r > 0 for r in values) / len(values)
        )
    return out


def validate(run: Run, pool, step: int, main: bool = True) -> float:
    """mean@G pass rate on the held-out split with the current weights; logged overall
    (``val_pass_rate``) and, for a mixture of sources, per domain
    (``val_pass_rate/<domain>``). Every rank calls it: the main rank generates and scores;
    the others take part when restarted engines wait for the weights (``on_every_rank``:
    a death with every engine down mid-validation), and return NaN."""
    if not main:  # waits for the whole pass, scoring included
        on_every_rank(run, pool, False, lambda: None, share=False, validation=True)
        return float("nan")
    cfg = run.config.validation
    # ``num_prompts`` counts per domain, so a cap never leaves a domain out.
    ids = [i for ids in run.data.val_by_domain().values() for i in ids[: cfg.num_prompts]]
    t0 = time.perf_counter()
    hours = run.clock.summary()  # the policy being measured cost this much

    def generate() -> list:  # asked again after a reweigh: the same seeds, the same samples
        if not ids:
            return []
        return pool.generate(
            [run.encode(i) for i in ids],
            seeds=[_sampling_seed(run.config.seed, -1 - i, step) for i in ids],
            samples_per_prompt=cfg.samples_per_prompt,
            temperature=cfg.temperature,
        )

    # Blocking validation, accounted apart; the training requests that PipelineRL generators
    # keep decoding meanwhile are training compute (their token share of the window).
    def score() -> tuple[list, list[str], list[float]] | None:
        samples = generate()  # scoring too: the other ranks wait until the pass is done
        if not samples:
            return None
        texts = [run.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        refs = [run.data.get(ids[s.prompt_index - samples[0].prompt_index]) for s in samples]
        kinds = [p.kind for p in refs]
        return samples, kinds, run.rewards.score_batch(texts, [p.reference for p in refs], kinds)

    with run.clock.window("validation") as window:
        tokens_before = pool.generated_tokens()
        scored = on_every_rank(run, pool, True, score, share=False, validation=True)
        if scored is None:
            return float("nan")
        samples, kinds, rewards = scored
        val_tokens = sum(len(s) for s in samples)
        train_tokens = pool.generated_tokens() - tokens_before - val_tokens
        window.train_fraction = generation_share(train_tokens, val_tokens)
    rate = sum(r > 0 for r in rewards) / len(rewards)
    if run.exporter is not None:
        run.exporter.val_pass_rate = rate  # for the README of the next export
    # A mixture (math + code) also logs each domain's pass rate: one curve per domain.
    mixture = len(run.data.sources) > 1
    per_domain = _by_domain("val_pass_rate", kinds, rewards, mean=False) if mixture else {}
    run.metrics.log(
        {
            "step": step,
            **hours,
            "val_pass_rate": rate,
            **per_domain,
            "val_samples": len(rewards),
            "val_reward_timeouts": run.rewards.last_counts["timeout"],
            "val_train_fraction": window.train_fraction,
            "val_seconds": time.perf_counter() - t0,
        }
    )
    domains = "".join(f"{k.split('/')[1]} {v:.3f}, " for k, v in per_domain.items())
    logger.info(
        "step %d: validation pass rate %.3f (%s%d samples)", step, rate, domains, len(rewards)
    )
    if run.forecast is not None:
        training = run.config.training
        budget = resolve_budget(
            run.config.forecast,
            training.max_gpu_hours,
            training.max_steps,
            step,
            hours["gpu_hours"],
        )
        run.forecast.submit(step, budget, hours["gpu_hours"])
    return rate


# -- set-up helpers ---------------------------------------------------------------------------


def resume_or_warm_start(run: Run) -> tuple[int, list[int]]:
    """Resume from the latest checkpoint (step, prompts to regenerate), or warm-start.

    The RL optimizer is built after the warm start (its fp32 main parameters copy the
    weights it starts from), or before loading a checkpoint's state into it.
    """
    from megatron_rl.trainer.optim import build_optimizer

    if run.checkpoints.latest() is None:
        run.metrics.truncate(0)
        warm_start(run)
        run.optim = build_optimizer(run.ddp, run.config.optimizer)
        return 0, []
    run.optim = build_optimizer(run.ddp, run.config.optimizer)
    ckpt = run.checkpoints.load(run.model, optimizer=run.optim.optimizer)
    extra = ckpt.extra
    run.optim.scheduler.load_state_dict(extra["scheduler"])
    run.sampler.load_state_dict(extra["sampler"])
    if run.tracker is not None:
        run.tracker.load_state_dict(extra["tracker"])
    run.clock.load_state_dict(extra["clock"])
    run.metrics.truncate(extra["metrics_position"])
    logger.info("resumed from %s at step %d", ckpt.path, ckpt.step)
    return ckpt.step, list(extra["in_flight"])


def warm_start(run: Run) -> None:
    """Supervised warm start on the training prompts' worked solutions (``warm_start.steps``)."""
    from megatron_rl.data import sft_example
    from megatron_rl.trainer.warm_start import fitting_examples, supervised_warm_start

    cfg = run.config.warm_start
    if cfg.steps <= 0:
        return
    tok, examples = run.tokenizer, []
    for prompt in run.data.train():
        if prompt.solution:
            config = run.data.config_of(prompt.prompt_id)
            text, target = sft_example(prompt.problem, prompt.solution, config, tok)
            target_ids = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            examples.append((tok(text)["input_ids"], target_ids))
    examples = fitting_examples(examples, run.model.max_sequence_length)
    if not examples:
        raise ValueError("warm_start.steps > 0 but no training prompt has a solution that fits")
    losses = supervised_warm_start(
        run.ddp,
        examples,
        cfg.steps,
        cfg.lr,
        cfg.batch_size,
        seed=run.config.seed,
        pad_id=tok.pad_token_id or 0,
    )
    run.metrics.log({"step": 0, **run.clock.summary(), "warm_start_loss": losses[-1]})


def start_generators(run: Run, step: int):
    """The vLLM pool, started from the run's HF directory and synced to the trainer's weights
    (policy version ``step + 1`` after the first push, so a resumed run numbers as before)."""
    from megatron_rl.rollout.pool import GeneratorPool

    tok = run.tokenizer
    rollout = run.config.rollout
    if rollout.dtype == "auto":  # generate in the trainer's dtype, or log-probs disagree
        rollout.dtype = run.config.model.dtype
    rollout.return_routed_experts |= run.config.algorithm.routing_replay
    if rollout.placement == "subprocess" and get_platform().is_gpu:
        from megatron_rl.platform import local_world_size
        from megatron_rl.rollout.config import engine_gpus

        # Engines on GPUs of their own, after this node's trainer ranks (torchrun's or srun's).
        local_trainers = local_world_size()
        rollout.gpu_ids = engine_gpus(rollout, local_trainers, run.config.cluster.gpus_per_node)
    pool = GeneratorPool(
        str(run.hf_dir),
        run.config.rollout,
        encode=lambda text: tok(text, add_special_tokens=False)["input_ids"],
        initial_version=step,
    )
    return pool


def push_weights(run: Run, pool, reweigh: bool = False, between=None):
    """Stream the trainer's weights (HF names, full tensors, bounded buckets) into the pool
    (``reweigh``: into restarted engines only, see ``GeneratorPool.reweigh``). Every rank
    calls this (the gathers are collectives); ``pool`` is None off the main rank.
    ``between``: called by the pool whenever the push waits or a bucket went out (the
    rollout source's ``feed``: the pool stays topped up through the push)."""
    from megatron_rl.rollout.weights.push import push_megatron_weights

    bucket_bytes = run.config.rollout.weight_bucket_bytes
    with torch.no_grad():
        return push_megatron_weights(
            pool, run.model, bucket_bytes, reweigh=reweigh, between=between
        )


def save_checkpoint(run: Run, step: int, source: RolloutSource, wait: bool = False) -> None:
    """Checkpoint ``step``: in the background if ``checkpoint.async_save`` unless ``wait``
    (a save on a signal or at the end must be complete before the process exits)."""
    with run.clock.window("checkpoint"):
        _save_checkpoint(run, step, source, wait)


def _save_checkpoint(run: Run, step: int, source: RolloutSource, wait: bool = False) -> None:
    extra = {
        "scheduler": run.optim.scheduler.state_dict(),
        "sampler": run.sampler.state_dict(),
        "tracker": run.tracker.state_dict() if run.tracker is not None else None,
        "clock": run.clock.state_dict(),
        "metrics_position": run.metrics.position(),
        "in_flight": source.in_flight_prompt_ids() if source is not None else [],
    }
    async_save = False if wait else None  # None: checkpoint.async_save
    export = None
    if run.exporter is not None and run.exporter.wants(step):  # once the save is complete
        notes = {"gpu_hours": run.clock.summary()["gpu_hours"]}
        exporter = run.exporter

        def export(path: Path) -> None:
            exporter.submit(step, path, notes)

    run.checkpoints.save(
        step,
        run.model,
        extra,
        optimizer=run.optim.optimizer,
        async_save=async_save,
        on_complete=export,
    )


def step_record(run: Run, step: int, info: dict, result, t0, t1, t2, push, pool) -> dict:
    """The metrics record of one step."""
    gen_seconds, train_seconds = t1 - t0, t2 - t1
    record = {
        "step": step,
        **run.clock.summary(),
        **info,
        "effective_batch_fraction": result.effective_batch_fraction,
        "npr_retired": run.tracker.num_retired if run.tracker is not None else 0,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "rho_mean": result.rho_mean,
        "rho_max": result.rho_max,
        "clip_frac": result.clip_frac,
        "abs_logprob_diff": result.abs_logprob_diff,
        "logprob_gap": result.logprob_gap,
        "logprob_gap_tokens": result.logprob_gap_tokens,
        "dp_token_imbalance": result.dp_token_imbalance,
        "train_tokens_per_s": result.num_tokens / max(train_seconds, 1e-9),
        "gen_wait_seconds": gen_seconds,
        "step_seconds": time.perf_counter() - t0,
        "policy_version": pool.version,
        "engine_restarts": pool.restarts,  # so far: engines that died and were restarted
    }
    if result.expert_load is not None:
        record.update(result.expert_load.summary())
    if push is not None:
        record.update(push_seconds=push.seconds, push_gb_per_s=push.gb_per_second)
    record["gen_tokens_per_s"] = info["response_tokens"] / max(record["step_seconds"], 1e-9)
    return record


def start_forecast(run: Run):
    """The live forecast of the run (``forecast.enabled`` with validation), else None."""
    from megatron_rl.trainer.live_forecast import LiveForecast

    if not (run.config.forecast.enabled and run.config.validation.enabled):
        return None
    png = run.run_dir / "reward_curve.png"
    return LiveForecast(
        run.metrics.path, run.config.forecast, png, run.config.name, run.metrics.log
    )


def finish_metrics(run: Run, step: int, finished: bool) -> None:
    """The last forecast (waited for at a normal end only) and, at a normal end, the
    ``run_finished`` record that tells ``megatron-rl fit --watch`` to stop."""
    from megatron_rl.trainer.live_forecast import FINAL_WAIT_SECONDS

    if run.forecast is not None:
        fields = lambda: {"step": step, **run.clock.summary()}  # noqa: E731
        run.forecast.close(fields, FINAL_WAIT_SECONDS if finished else 0.0)
    if finished:
        run.metrics.log({"step": step, **run.clock.summary(), "run_finished": True})


def _is_main() -> bool:
    return _rank() == 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _due(step: int, every: int) -> bool:
    """Every ``every`` steps; 0 = never (checkpoints: only on signals and at the end)."""
    return every > 0 and step % every == 0


def _sampling_seed(seed: int, prompt_id: int, step: int) -> int:
    """Sampling seed of a prompt submitted at ``step``: the same in a resumed run."""
    return (seed * 1_000_003 + prompt_id * 10_007 + step * 101 + 17) % (2**62)


def _lag(config: RunConfig) -> int:
    return (
        config.off_policy.max_lag
        if config.off_policy.mode == "pipeline_rl"
        else config.off_policy.k
    )


def _budget_spent(run: Run) -> bool:
    limit = run.config.training.max_gpu_hours
    return limit is not None and run.clock.gpu_hours >= limit


def _plot(run: Run) -> None:
    from megatron_rl.scaling.records import plot_reward_curve

    try:
        latest = run.forecast.latest if run.forecast is not None else None
        png = run.run_dir / "reward_curve.png"
        plot_reward_curve(
            run.metrics.path,
            png,
            title=run.config.name,
            forecast=latest.overall if latest is not None else None,
            domain_forecasts=latest.domains if latest is not None else None,
        )
    except Exception as err:  # a plot must never fail a finished run
        logger.warning("could not plot the reward curve: %s", err)


class _StopFlag:
    """Set by SIGTERM / SIGUSR1 (Slurm preemption): checkpoint at the next step, then exit."""

    def __init__(self, names) -> None:
        self.requested: str | None = None
        for name in names:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

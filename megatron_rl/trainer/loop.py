"""The RL training loop (ScaleRL): generate, reward, filter, update, push weights in flight."""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from tqdm import tqdm

from megatron_rl.config.schema import RunConfig
from megatron_rl.platform import collectives, get_platform, watchdog
from megatron_rl.rewards.pool import RewardFailure
from megatron_rl.rollout.samples import TOOL_VERSION
from megatron_rl.rollout.weights import m2n_ranks
from megatron_rl.trainer import console, hf_export, summary, validation
from megatron_rl.trainer.batch import TrainSample, token_multiple
from megatron_rl.trainer.handoff import RankZeroWaits, on_every_rank, push_weights, rank_zero_waits
from megatron_rl.trainer.probe import LogprobProbe
from megatron_rl.trainer.rollout_source import (
    PromptsExhausted,
    RolloutSource,
    token_lag_histogram,
)
from megatron_rl.trainer.rundir import AlreadyFinished
from megatron_rl.trainer.scoring import dynamic_sampling, score_groups
from megatron_rl.trainer.setup import Run, build_run
from megatron_rl.trainer.step import policy_update, recompute_old_logprobs
from megatron_rl.trainer.validation import OwedValidation, ValidationStopped, sampling_seed

if TYPE_CHECKING:
    from megatron_rl.rollout import GeneratorPool, PushStats, RolloutConfig
    from megatron_rl.trainer.live_forecast import LiveForecast
    from megatron_rl.trainer.metrics import MetricsLogger
    from megatron_rl.trainer.optim import Optimizer
    from megatron_rl.trainer.probe import ProbeResult
    from megatron_rl.trainer.setup import NullMetrics
    from megatron_rl.trainer.step import StepResult

logger = logging.getLogger(__name__)
T = TypeVar("T")


def train(
    config: RunConfig, run_dir: Path, restart: bool = False, allow_changes: bool = False
) -> int:
    """Run (or resume) the recipe in ``run_dir`` on every trainer rank. Returns an exit code.

    The main rank (global rank 0) owns the generator pool, the rollout source, rewards,
    validation and metrics; each step it broadcasts the scored batch to all ranks, which
    update together (TP inside the model, DP by groups) and push weights collectively.
    ``config`` is never changed: what the run derives from it lives in the :class:`Trainer`.
    """
    # The signals of a preemption are caught from the start: a job signalled while it warm-starts
    # or starts its engines stops at once (nothing to checkpoint yet) and exits as a stop on a
    # signal does, for the requeue; a signal later stops the loop after a checkpoint.
    stop = StopFlag(config.checkpoint.on_signals)
    try:
        # claims run_dir; resumes or warm-starts; starts the engines with the trainer's weights
        trainer = Trainer(config, Path(run_dir), restart, allow_changes, stop)
    except AlreadyFinished as done:  # every rank, before anything was built
        if _is_main():
            logger.info("%s", done)
        return 0
    except BaseException as err:
        if (stop.requested is None and not isinstance(err, Preempted)) or stop.interrupted:
            raise
        signal_name = stop.requested or "a signal to another rank"
        if not isinstance(err, Preempted):  # e.g. an engine process the group's signal ended
            logger.warning("start-up failed after %s: %r", signal_name, err, exc_info=err)
        logger.info(
            "stopping on %s during start-up (%s): no step was trained since the last "
            "checkpoint, nothing to save; the next run resumes from it, or starts over",
            signal_name,
            err if isinstance(err, Preempted) else "its error above",
        )
        return 0
    first_step, outcome = trainer.step, "failed (the error follows)"
    finished = False
    try:
        if trainer.owed_validation():  # at the start, or put off by a stop on a signal
            trainer.validate()  # a signal stops it: owed again
            if trainer.signalled():
                if trainer.step > 0:  # the checkpoint resumed from is the latest, and owes it
                    outcome = _stopped(trainer, "before its first step (nothing new to save)")
                    return 0
                # No checkpoint yet (a warm start may be hours of work): step 1 is trained and
                # checkpointed first, as for any signal; the point at C = 0 is not made up.
                trainer.forgive_start_validation()
        trainer.begin()  # the x axis (training compute) starts; progress bar; hang watchdog
        while trainer.step < config.training.max_steps:
            t0 = time.perf_counter()
            batch = trainer.next_batch()  # generated and rewarded by the main rank, shared
            if batch is None:  # every prompt retired, or the GPU-hour budget spent
                break
            t1 = time.perf_counter()
            result = trainer.update(batch)  # one optimizer step (the engines keep generating)
            t2 = time.perf_counter()
            push, probed = trainer.push_weights(batch.wants_push)  # in flight, then probed
            trainer.log_step(batch, result, push, probed, (t0, t1, t2))
            watchdog.beat(f"step {trainer.step}: validation and checkpoint")
            trainer.finalize_checkpoint()  # an async save whose write is done completes
            # A signal is answered before a validation, which may outlast the signal's window
            # (SIGKILL): checkpoint first; the resumed run validates this step before its next.
            signalled = trainer.signalled()
            if _due(trainer.step, config.validation.every_steps) and config.validation.enabled:
                if signalled:
                    trainer.owe_validation()
                else:
                    # publishes the save in flight first; a signal during it stops it (owed)
                    trainer.validate()
                    signalled = trainer.signalled()  # one that came during the validation
            if _due(trainer.step, config.checkpoint.every_steps) or signalled:
                trainer.save_checkpoint(wait=signalled)
            if signalled:
                outcome = _stopped(trainer, f"after checkpointing step {trainer.step}")
                return 0
        # validation and checkpoint of the last step, unless done already; False: a signal
        # stopped that validation (owed by the checkpoint saved then)
        if not trainer.finish():
            outcome = _stopped(trainer, f"after checkpointing step {trainer.step}")
            return 0
        finished, outcome = True, "finished"
    except KeyboardInterrupt:  # a second Ctrl-C (the first one stops after a checkpoint)
        again = "a second SIGINT" if stop.interrupted else "SIGINT (not in checkpoint.on_signals)"
        outcome = (
            f"interrupted by {again}: stopped at once, nothing saved since the last checkpoint"
        )
        raise
    finally:
        trainer.close(finished)
        summary.log_end(config, trainer.run, first_step, trainer.step, outcome, trainer.main)
    return 0


def _stopped(trainer: Trainer, where: str) -> str:
    """Log a stop on a signal (``where``: after what); the run's outcome."""
    signal_name = trainer.stop.requested or "a signal to another rank"
    logger.info("stopping on %s %s", signal_name, where)
    return f"stopped on {signal_name}"


class Preempted(Exception):
    """A preemption's signal came while the run started (before its first step): start-up
    stops at the next safe point, every rank together."""


class Stateful(Protocol):
    """What a checkpoint saves and restores (torch's ``Stateful``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class MetricsPosition:
    """The metrics file's length at a checkpoint: a resumed run cuts the records after it."""

    def __init__(self, metrics: MetricsLogger | NullMetrics) -> None:
        self.metrics = metrics

    def state_dict(self) -> int:
        return self.metrics.position()

    def load_state_dict(self, position: int) -> None:
        self.metrics.truncate(position)


class InFlight:
    """The prompts in flight at a checkpoint (their samples die with the engines): saved from
    the rollout source (main rank), regenerated by the resumed run (``prompt_ids``)."""

    def __init__(self, source: RolloutSource | None = None) -> None:
        self.source = source
        self.prompt_ids: list[int] = []
        # prompts of batches the trainer took from the source ahead of their step (the rest
        # of a round under algorithm.mismatch_reference recompute): in flight as well
        self.held: list[int] = []

    def state_dict(self) -> list[int]:
        if self.source is None:
            return []
        return self.source.in_flight_prompt_ids() + self.held

    def load_state_dict(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)


@dataclass(frozen=True)
class Batch:
    """One step's training batch, the same on every rank (``next_batch``)."""

    samples: list[TrainSample]
    info: dict[str, Any]  # the step's batch metrics (rewards, staleness, counts ...)
    wants_push: bool  # the update is pushed to the engines (PipelineRL: always)
    generator_version: int  # the policy version the engines held when the batch was taken


class Trainer:
    """One training run on this rank, built and synced (torchtitan's ``Trainer``): the run's
    components (``run``), the optimizer, the engines and the rollout source (main rank), the
    loop's own state. What a checkpoint holds beside the model and optimizer is declared once,
    in :func:`checkpointed`; ``config`` is read, never written."""

    config: RunConfig
    main: bool  # global rank 0: owns the pool, the source, rewards, validation, metrics
    run: Run
    optim: Optimizer  # built after the warm start (its main parameters copy those weights)
    step: int  # optimizer steps done
    in_flight: InFlight  # prompts to regenerate on resume
    owed: OwedValidation  # a validation a stop put off, done by the resumed run first
    paid: int | None  # the step whose owed validation this run did (its checkpoint owes it)
    pool: GeneratorPool | None  # main rank
    waits: RankZeroWaits
    forecast: LiveForecast | None  # main rank, forecast.enabled with validation
    source: RolloutSource | None  # main rank
    synced: bool  # the trainer holds the generator's current policy (after a push)
    gap_limit: float | None  # training.max_logprob_gap in force
    token_multiple: int  # sequence padding (FP8)
    probe: LogprobProbe
    stop: StopFlag
    bar: tqdm | None  # from begin() on
    round: list[Batch]  # mismatch_reference recompute: the round's batches not yet handed out
    unrecomputed: list[Batch]  # the round's batches, until its first update recomputes them

    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        restart: bool = False,
        allow_changes: bool = False,
        stop: StopFlag | None = None,
    ) -> None:
        self.config = config
        self.stop = stop if stop is not None else StopFlag(config.checkpoint.on_signals)
        self.run = build_run(config, run_dir, restart, allow_changes)  # rundir.py claims
        self.main = _is_main()  # once build_run has joined the process group
        # The console's first line (before the warm start, the engines and their output).
        summary.log_start(config, self.run, summary.resume_step(self.run), self.main)
        self.step, self.pool, self.forecast, self.source, self.bar = 0, None, None, None, None
        self.round, self.unrecomputed, self.paid = [], [], None
        try:
            self._start()
        except BaseException:
            with contextlib.suppress(Exception):  # the start-up's error is the one to see
                self.close(False)
            raise

    def _start(self) -> None:
        """Resume or warm-start, start the engines, push the weights: the start-up, which a
        preemption's signal stops at its next phase (:class:`Preempted`)."""
        config, run = self.config, self.run
        self._check_stop("before the warm start or resume")
        self.in_flight, self.owed = InFlight(), OwedValidation()
        self.optim, self.step = resume_or_warm_start(
            run, self.in_flight, lambda: self._check_stop("during the warm start"), self.owed
        )
        self._check_stop("after the warm start or resume")
        # Engines can take many minutes to load (Scout); the other ranks wait meanwhile on a
        # gloo group whose timeout is the start-up's, not in a collective with the world's.
        wait = config.rollout.startup_timeout_minutes
        startup = collectives.timed_group(wait)
        engines = f"starting {config.rollout.engines} engine(s)"
        with console.phase(engines, self.main), m2n_ranks.serving(run.model, config.rollout):
            self.pool = start_generators(run, self.step) if self.main else None
        collectives.barrier(startup, wait, timeout_key="rollout.startup_timeout_minutes")
        self._check_stop("while the engines started")
        self.waits = rank_zero_waits(config)
        with console.phase("pushing the weights to the engines", self.main):
            push_weights(run, self.pool)  # warm-started or resumed weights
        self.forecast = start_forecast(run) if self.main else None
        self.source = self._rollout_source() if self.main else None
        if run.exporter is not None:  # the exports a stop left undone (main rank)
            run.exporter.resume(run.checkpoints.checkpoints())
        if self.source is not None:  # prompts in flight at the last checkpoint are regenerated
            self.source.submit(self.in_flight.prompt_ids)
        self.in_flight.source = self.source
        # The trainer's weights are those of the generator's current policy version right
        # after a push; an update without a push (PPO-off-policy-k) puts the trainer ahead of
        # every sample, and the log-prob gap monitor then has nothing exact to compare.
        self.synced = True
        quantization = config.rollout.quantization  # FP8 engines: their own limit
        self.gap_limit = config.training.logprob_gap_limit(config.model.dtype, quantization)
        self.gap_key = config.training.logprob_gap_key(quantization)
        parallel = config.parallel
        self.token_multiple = token_multiple(
            config.model.fp8_scaling, parallel.tensor, parallel.sequence_parallel
        )
        # The monitor above sees only the first PipelineRL batch: probe pushes as well.
        self.probe = LogprobProbe.from_run(run, self.step, self.token_multiple)

    def _check_stop(self, phase: str) -> None:
        """Raise :class:`Preempted` on every rank if any rank was signalled (a collective:
        every rank calls it at the same point of the start-up)."""
        if collectives.any_rank(self.stop.requested is not None):
            raise Preempted(phase)

    def _rollout_source(self) -> RolloutSource:
        config = self.config
        return RolloutSource(
            self.pool,
            self.run.sampler.next_prompts,
            self.run.encode,
            config.batch.prompts_per_step,
            config.batch.samples_per_prompt,
            config.off_policy.mode,
            _lag(config),
            seed_of=lambda prompt_id: sampling_seed(config.seed, prompt_id, self.step),
            shuffle_seed=config.seed,
            dynamic=dynamic_sampling(self.run),
            capacity=config.rollout.engines * config.rollout.max_num_seqs,
            fill=config.off_policy.pool_fill,
            problem_of=self.run.data.get if config.rollout.episodes else None,
        )

    def begin(self) -> None:
        """The training steps begin: the x axis (all but validation and checkpoints from here
        on), the progress bar, the hang watchdog (a rank stuck outside a collective exits with
        a stack dump: a requeue, not a lost day)."""
        self.run.clock.begin("train")
        logger.info("training: steps %d to %d", self.step + 1, self.config.training.max_steps)
        self.bar = tqdm(
            total=self.config.training.max_steps,
            initial=self.step,
            desc="train",
            file=console.stream(),
            disable=not (console.bars_shown(self.main) and self.config.logging.progress_bar),
        )
        watchdog.arm(self.config.training.hang_timeout_minutes, self.run.run_dir, _rank())

    def next_batch(self) -> Batch | None:
        """The next step's batch on every rank (generated and rewarded on the main rank), or
        None when training must end."""
        watchdog.beat(f"step {self.step + 1}: batch")
        if self.config.algorithm.recompute:
            batch = self._next_round_batch()
        else:
            batch = self._fetch_batch()
        if batch is not None:
            batch.info["lr"] = self.optim.lr  # the rate of this update (the scheduler moves on)
        return batch

    def _fetch_batch(self) -> Batch | None:
        batch = self._on_every_rank(lambda: next_batch(self.run, self.source, self.pool, self.step))
        if isinstance(batch, RewardFailure):  # the main rank's reward failed: every rank stops
            raise batch
        return batch

    def _next_round_batch(self) -> Batch | None:
        """``algorithm.mismatch_reference: recompute`` (PPO-off-policy-k): at a round's first
        step, take all its batches (up to the one after which the weights are pushed; their
        pi_old is recomputed by that step's :meth:`update`), then hand them out one a step."""
        if not self.round:
            first = self._fetch_batch()
            if first is None:
                return None
            batches = [first]
            while not batches[-1].wants_push:
                more = self._fetch_batch()
                if more is None:  # prompts exhausted or budget spent: train what was taken
                    break
                batches.append(more)
            self._check_round(batches)
            self.round, self.unrecomputed = batches, list(batches)
        batch = self.round.pop(0)
        self.in_flight.held = [
            pid for b in self.round for pid in dict.fromkeys(s.prompt_id for s in b.samples)
        ]
        return batch

    def _recompute_round(self, batch: Batch) -> None:
        """Before a round's first update (``batch``): pi_old of all the round's batches at the
        current weights, which generated them all (the pool is idle during a round and the
        push comes after its last update; :meth:`_check_round`). ``recompute_seconds``: that
        forward, in the round's first step; 0 in the others."""
        batches, self.unrecomputed = self.unrecomputed, []
        if not batches:
            batch.info["recompute_seconds"] = 0.0
            return
        if batches[0] is not batch:
            raise RuntimeError("the round's pi_old must be recomputed before its first update")
        start = time.perf_counter()
        recompute_old_logprobs(
            self.run.ddp,
            [b.samples for b in batches],
            self.config.algorithm,
            self.config.batch.micro_batch_size,
            self.config.rollout.temperature,
            # the first update is monitored (see update()): the same rank shares as there
            [batch.generator_version if self.synced else None] + [None] * (len(batches) - 1),
            self.token_multiple,
            self.config.batch.micro_batch_tokens,
            self.config.batch.pack,
        )
        batch.info["recompute_seconds"] = time.perf_counter() - start

    def _check_round(self, batches: list[Batch]) -> None:
        """The recompute is exact only at the weights that generated every sample of the
        round: the trainer's own (synced: just pushed) and the generator's version of each
        sample's every token (a RuntimeError otherwise: never a silent approximation)."""
        version = batches[0].generator_version
        stale = [
            s.prompt_id
            for b in batches
            for s in b.samples
            if b.generator_version != version or set(s.versions) - {TOOL_VERSION} - {version}
        ]
        if not self.synced or stale:
            raise RuntimeError(
                "algorithm.mismatch_reference recompute: the round's samples were not all "
                f"generated by the trainer's current weights (policy version {version}; "
                f"trainer synced: {self.synced}; prompts of other versions: {stale[:8]})"
            )

    def update(self, batch: Batch) -> StepResult:
        """One optimizer step on ``batch``; the main rank's feeder keeps the engines topped up
        meanwhile (PipelineRL)."""
        config = self.config
        watchdog.beat(f"step {self.step + 1}: update")
        if config.algorithm.recompute:  # the round's pi_old (its first update; else nothing)
            self._recompute_round(batch)
        with self.source.feeding() if self.source is not None else contextlib.nullcontext():
            result = policy_update(
                self.run.ddp,
                self.optim.optimizer,
                batch.samples,
                config.algorithm,
                config.batch.micro_batch_size,
                micro_batch_tokens=config.batch.micro_batch_tokens,
                pack=config.batch.pack,
                temperature=config.rollout.temperature,
                monitor_version=batch.generator_version if self.synced else None,
                max_logprob_gap=self.gap_limit,
                max_logprob_gap_key=self.gap_key,
                token_multiple=self.token_multiple,
            )
        self.synced = batch.wants_push
        self.optim.scheduler.step(increment=1)
        self.step += 1
        return result

    def push_weights(self, wanted: bool) -> tuple[PushStats | None, ProbeResult | None]:
        """Push the update's weights into the engines (``wanted``) while the source keeps them
        fed (requests in flight keep decoding); then the post-push log-prob probe, if due."""
        watchdog.beat(f"step {self.step}: push")
        feed = self.source.feed if self.source is not None else None
        push = push_weights(self.run, self.pool, between=feed) if wanted else None
        probed = self.probe.after_push(
            self.run.ddp, self.pool, self.step, wanted, lambda make: self._on_every_rank(make)
        )
        return push, probed

    def log_step(
        self,
        batch: Batch,
        result: StepResult,
        push: PushStats | None,
        probed: ProbeResult | None,
        times: tuple[float, float, float],
    ) -> None:
        """The step's record (main rank); the probe's verdict (every rank, after the record:
        the failing gap is logged); progress and the live forecast."""
        run, step = self.run, self.step
        if self.main:
            record = step_record(run, step, batch.info, result, *times, push, self.pool)
            record.update(self.source.generator_load())  # over this step
            run.metrics.log({**record, **(probed.metrics() if probed else {})})
            if result.expert_load is not None:
                run.metrics.log_tensorboard(step, result.expert_load.per_layer())
        self.probe.check(probed)
        if self.main:
            self.bar.update(1)
            info = batch.info
            self.bar.set_postfix(reward=f"{info['reward_mean']:.2f}", lag=info["staleness_max"])
            if self.forecast is not None:
                self.forecast.poll({"step": step, **run.clock.summary()})
            if run.exporter is not None:
                run.exporter.poll()

    def validate(self, at_end: bool = False) -> float:
        """Validate the current weights (``validation.validate``; ``at_end``: the one of
        ``finish``).
        A save in flight is published first: a validation may run for longer than a signal's
        window, and a save complete on disk but not published when the job is killed would
        be lost. A stop's signal during it (on the main rank) gives it up on every rank, its
        requests cancelled: it is owed again (:meth:`owe_validation`), the step's checkpoint
        comes first (the caller's), and NaN is returned. When the reward fails in it
        (``RewardFailure``, on every rank), the step was trained all the same: its
        checkpoint, if due now, is saved before the error ends the run."""
        self.finalize_checkpoint(blocking=True)
        paid = self.paid
        if self.owed.step == self.step:  # its checkpoint owes it: a new one must not
            self.paid = self.step
        self.owed.step = None
        stop = self.stop
        try:
            return validation.validate(
                self.run,
                self.pool,
                self.step,
                self.main,
                self.waits,
                self.forecast,
                stopped=lambda: stop.requested is not None,
            )
        except ValidationStopped as err:
            logger.info("%s: owed, the resumed run validates step %d first", err, self.step)
            self.paid = paid
            self.owe_validation()
            return float("nan")
        except RewardFailure:
            checkpoint = self.config.checkpoint
            due = _due(self.step, checkpoint.every_steps) or (at_end and checkpoint.save_at_end)
            if self.step > 0 and due:
                logger.error(
                    "the reward failed in the validation of step %d: saving the step's "
                    "checkpoint before the run stops",
                    self.step,
                )
                self.save_checkpoint(wait=True)
            raise

    def signalled(self) -> bool:
        """Whether any rank was asked to stop (a collective: every rank asks at the same
        point)."""
        return collectives.any_rank(self.stop.requested is not None)

    def owe_validation(self) -> None:
        """This step's validation is put off by a stop: its checkpoint says so, and the
        resumed run validates first (:meth:`owed_validation`)."""
        self.owed.step = self.step

    def forgive_start_validation(self) -> None:
        """The validation at step 0 that a signal stopped is not owed: the run has no
        checkpoint to owe it; it trains step 1 and checkpoints."""
        if self.owed.step == 0:
            logger.warning(
                "the validation at the start was stopped by a signal and is not made up: "
                "step 1 is trained and checkpointed first (no checkpoint yet)"
            )
        self.owed.step = None

    def owed_validation(self) -> bool:
        """Whether a validation is due before the first step: at the start of a run
        (``validation.at_start``), or the one a stop put off at this step."""
        validation = self.config.validation
        at_start = self.step == 0 and validation.at_start
        return validation.enabled and (at_start or self.owed.step == self.step)

    def save_checkpoint(self, wait: bool = False) -> None:
        """Checkpoint this step: in the background if ``checkpoint.async_save`` unless
        ``wait`` (a save on a signal or at the end must be complete before the process
        exits); its HF export, if due, once the save is complete."""
        states = checkpointed(self.run, self.optim, self.in_flight, self.owed)
        save_checkpoint(self.run, self.step, self.optim, states, wait)

    def finalize_checkpoint(self, blocking: bool = False) -> None:
        """Complete an async save whose write is done (``blocking``: wait for it); on every
        rank (a collective while a save is in flight)."""
        with self.run.clock.window("checkpoint"):
            self.run.checkpoints.finalize(blocking=blocking)

    def finish(self) -> bool:
        """At the end: validation and a checkpoint of the last step, unless done already.
        False: a stop's signal gave that validation up; the checkpoint that owes it is saved,
        and the run is not finished (its resume validates, then ends)."""
        validation, checkpoint = self.config.validation, self.config.checkpoint
        validated_at_end = validation.enabled and self.step % validation.every_steps != 0
        validated_at_end = validated_at_end and self.paid != self.step  # done at the start
        if validated_at_end:
            self.validate(at_end=True)
            if self.owed.step == self.step:  # stopped by a signal
                self.save_checkpoint(wait=True)
                self.finalize_checkpoint(blocking=True)
                return False
        # The loop's own checkpoint of this step holds everything unless validation ran since
        # (at the end, or the one that checkpoint owed, paid by a resumed run).
        saved = self.step > 0 and _due(self.step, checkpoint.every_steps) and not validated_at_end
        saved = saved and self.paid != self.step
        if checkpoint.save_at_end and not saved:
            self.save_checkpoint(wait=True)
        self.finalize_checkpoint(blocking=True)
        return True

    def close(self, finished: bool) -> None:
        """Stop the engines, the reward workers and the metrics (``finished``: a normal end,
        the ``run_finished`` record); the reward curve on the main rank."""
        run = self.run
        watchdog.disarm()
        run.checkpoints.abandon()  # an error's path: no collective (a normal end finalized)
        run.clock.begin("shutdown")
        if self.bar is not None:
            self.bar.close()
        if self.pool is not None:
            self.pool.close()
        run.rewards.close()
        if run.exporter is not None and finished:  # the last export is waited for
            run.exporter.close(hf_export.FINAL_WAIT_SECONDS)
        elif run.exporter is not None:  # a stop does not wait: the next run exports it
            run.exporter.interrupt()
        if self.main:
            finish_metrics(run, self.forecast, self.step, finished)
        run.metrics.close()
        if finished and self.main:
            _plot(run, self.forecast)

    def _on_every_rank(self, make: Callable[[], T]) -> T | None:
        return on_every_rank(self.run, self.pool, self.main, make, self.waits.batch)


def next_batch(
    run: Run, source: RolloutSource, pool: GeneratorPool, step: int = 0
) -> Batch | RewardFailure | None:
    """The batch of step ``step + 1``, or None when training must end (main rank only);
    raises ``WeightsNeeded`` (see :func:`on_every_rank`). A ``RewardFailure`` of its scoring
    is returned, to be handed to every rank."""
    if _budget_spent(run):
        logger.info("GPU-hour budget spent: stopping at step %d", step)
        return None
    try:
        groups = source.next_batch(pool.version)  # dynamic sampling scores groups in it
        samples, info = score_groups(run, groups, pool.version)
    except PromptsExhausted:
        logger.info("every training prompt is retired: stopping at step %d", step)
        return None
    except RewardFailure as err:
        return err
    info["staleness_hist"] = token_lag_histogram(groups, pool.version, _lag(run.config))
    info["generator_version"] = pool.version  # of the weights the generator holds now
    info.update(source.counts)  # prompts drawn this step; dynamic sampling's kept / dropped
    return Batch(samples, info, source.wants_push(), pool.version)


# -- set-up helpers ---------------------------------------------------------------------------


def checkpointed(
    run: Run, optim: Optimizer, in_flight: InFlight, owed: OwedValidation | None = None
) -> dict[str, Stateful | None]:
    """The loop state a checkpoint's extras hold beside the model and optimizer, by key:
    each entry's ``state_dict()`` is saved under it and comes back through its
    ``load_state_dict()`` (None: nothing to keep, e.g. no pass-rate history; an entry a
    checkpoint lacks, written before it existed, keeps its initial state)."""
    return {
        "scheduler": optim,  # the scheduler's state; the settings are the config's
        "sampler": run.sampler,
        "tracker": run.tracker,  # No-Positive-Resampling's pass-rate history
        "clock": run.clock,
        "metrics_position": MetricsPosition(run.metrics),
        "in_flight": in_flight,
        "owed_validation": owed,
    }


# entries of :func:`checkpointed` that older checkpoints lack: their initial state then
_ADDED_SINCE = ("owed_validation",)


def resume_or_warm_start(
    run: Run,
    in_flight: InFlight,
    before_step: Callable[[], None] | None = None,
    owed: OwedValidation | None = None,
) -> tuple[Optimizer, int]:
    """The RL optimizer and the step: resumed from the latest checkpoint (with the loop state
    of :func:`checkpointed`, the prompts to regenerate into ``in_flight``), or step 0 after
    the warm start (``before_step``: called before each of its steps, see ``warm_start``).
    Without a checkpoint the metrics start empty: the records of a run stopped before its
    first checkpoint (a warm start, steps) are written again, not twice.

    The RL optimizer is built after the warm start (its fp32 main parameters copy the
    weights it starts from), or before loading a checkpoint's state into it.
    """
    from megatron_rl.trainer.optim import build_optimizer

    if run.checkpoints.latest() is None:
        run.metrics.truncate(0)
        warm_start(run, before_step)
        return build_optimizer(run.ddp, run.config.optimizer), 0
    optim = build_optimizer(run.ddp, run.config.optimizer)
    ckpt = run.checkpoints.load(run.model, optimizer=optim.optimizer)
    for key, state in checkpointed(run, optim, in_flight, owed).items():
        if state is not None and (key in ckpt.extra or key not in _ADDED_SINCE):
            state.load_state_dict(ckpt.extra[key])
    logger.info("resumed from %s at step %d", ckpt.path, ckpt.step)
    return optim, ckpt.step


def warm_start(run: Run, before_step: Callable[[], None] | None = None) -> None:
    """Supervised warm start on the training prompts' worked solutions (``warm_start.steps``);
    ``before_step`` is called before each step (it raises to stop it: a preemption)."""
    from megatron_rl.trainer.setup import template_kwargs
    from megatron_rl.trainer.warm_start import (
        fitting_examples,
        supervised_warm_start,
        warm_start_examples,
    )

    cfg = run.config.warm_start
    if cfg.steps <= 0:
        return
    tok = run.tokenizer
    tools = template_kwargs(run.config, tok)  # multi-turn: the tool, as the prompts offer it
    examples = warm_start_examples(run.data, tok, tools)
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
        before_step=before_step,
    )
    run.metrics.log({"step": 0, **run.clock.summary(), "warm_start_loss": losses[-1]})


def engine_config(config: RunConfig, on_gpu: bool | None = None) -> RolloutConfig:
    """``config.rollout`` with what the run derives for its engines (a copy; the recipe's
    config is left as loaded): ``dtype: auto`` -> the trainer's, routed experts returned for
    routing replay, and on a GPU the engines' own GPUs (``placement: subprocess``).
    ``on_gpu``: whether the run is on GPUs (None: the platform's answer)."""
    import dataclasses

    rollout = config.rollout
    derived = {
        # generate in the trainer's dtype, or log-probs disagree
        "dtype": config.model.dtype if rollout.dtype == "auto" else rollout.dtype,
        "return_routed_experts": rollout.return_routed_experts or config.algorithm.routing_replay,
    }
    if on_gpu is None:
        on_gpu = get_platform().is_gpu
    if rollout.placement == "subprocess" and on_gpu:
        from megatron_rl.platform import local_world_size
        from megatron_rl.rollout.config import engine_gpus

        # Engines on GPUs of their own, after this node's trainer ranks (torchrun's or srun's).
        local_trainers = local_world_size()
        derived["gpu_ids"] = engine_gpus(rollout, local_trainers, config.cluster.gpus_per_node)
    return dataclasses.replace(rollout, **derived)


def start_generators(
    run: Run,
    step: int,
    make_pool: Callable[..., GeneratorPool] | None = None,
    on_gpu: bool | None = None,
) -> GeneratorPool:
    """The vLLM pool (:func:`engine_config`), started from the run's HF directory and synced
    to the trainer's weights (policy version ``step + 1`` after the first push, so a resumed
    run numbers as before). ``make_pool``: called as ``GeneratorPool`` is (None: it);
    ``on_gpu``: see :func:`engine_config`."""
    from megatron_rl.rollout.pool import GeneratorPool

    make_pool = make_pool or GeneratorPool
    tok = run.tokenizer
    rollout = run.config.rollout
    logger.info("starting %d engine(s) (%s)", rollout.engines, rollout.placement)
    return make_pool(
        str(run.hf_dir),
        engine_config(run.config, on_gpu),
        encode=lambda text: tok(text, add_special_tokens=False)["input_ids"],
        initial_version=step,
        sandbox=run.config.reward,  # multi-turn episodes: their tools run in the reward's box
    )


def save_checkpoint(
    run: Run, step: int, optim: Optimizer, states: dict[str, Stateful | None], wait: bool = False
) -> None:
    """Checkpoint ``step``: the model, the optimizer and ``states`` (:func:`checkpointed`); in
    the background if ``checkpoint.async_save`` unless ``wait``. The HF export of an export
    step (``checkpoint.export_hf_every``) starts once the checkpoint is complete."""
    export = None
    if run.exporter is not None and run.exporter.wants(step):
        # as of this step: an async save completes steps later, maybe after another validation
        exporter = run.exporter
        notes = {
            "gpu_hours": run.clock.summary()["gpu_hours"],
            "val_pass_rate": exporter.val_pass_rate,
        }

        def export(path: Path) -> None:
            exporter.submit(step, path, notes)

    with run.clock.window("checkpoint"):
        extra = {
            key: None if state is None else state.state_dict() for key, state in states.items()
        }
        run.checkpoints.save(
            step,
            run.model,
            extra,
            optimizer=optim.optimizer,
            async_save=False if wait else None,  # None: checkpoint.async_save
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
        # train-inference mismatch (algorithm.mismatch): k3 KL, the correction's weights
        "mismatch_kl": result.mismatch_kl,
        "is_weight_mean": result.is_weight_mean,
        "is_weight_max": result.is_weight_max,
        "mismatch_truncated_frac": result.mismatch_truncated_frac,
        "mismatch_masked_frac": result.mismatch_masked_frac,
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


def finish_metrics(run: Run, forecast: LiveForecast | None, step: int, finished: bool) -> None:
    """The last forecast (waited for at a normal end only) and, at a normal end, the
    ``run_finished`` record that tells ``megatron-rl fit --watch`` to stop."""
    from megatron_rl.trainer.live_forecast import FINAL_WAIT_SECONDS

    if forecast is not None:
        fields = lambda: {"step": step, **run.clock.summary()}  # noqa: E731
        forecast.close(fields, FINAL_WAIT_SECONDS if finished else 0.0)
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


def _lag(config: RunConfig) -> int:
    return (
        config.off_policy.max_lag
        if config.off_policy.mode == "pipeline_rl"
        else config.off_policy.k
    )


def _budget_spent(run: Run) -> bool:
    limit = run.config.training.max_gpu_hours
    return limit is not None and run.clock.gpu_hours >= limit


def _plot(run: Run, forecast: LiveForecast | None) -> None:
    from megatron_rl.scaling.records import plot_reward_curve

    try:
        latest = forecast.latest if forecast is not None else None
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


class StopFlag:
    """Set by the signals of ``checkpoint.on_signals`` (Slurm preemption: SIGTERM / SIGUSR1;
    Ctrl-C: SIGINT): checkpoint at the next step, then exit 0. A second SIGINT stops at once
    (``KeyboardInterrupt``, ``interrupted``): Ctrl-C twice when the checkpoint is not wanted."""

    def __init__(self, names) -> None:
        self.requested: str | None = None
        self.interrupted = False
        for name in names:
            signal.signal(getattr(signal, name), self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            self.interrupted = True
            raise KeyboardInterrupt(f"a second SIGINT (the first: {self.requested})")
        if self.requested is None:
            logger.warning(
                "%s: stopping after the current step and its checkpoint%s",
                name,
                " (Ctrl-C again: stop at once, without it)" if signum == signal.SIGINT else "",
            )
        self.requested = name

"""The main rank's long work that every trainer rank waits for (a batch, a validation pass,
a probe): :func:`on_every_rank` runs it on the main rank, which drives the engines, and hands
its value (or its ``RewardFailure``) to every rank; restarted engines that wait for the
weights are fed by every rank together (:func:`push_weights`, a collective)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from megatron_rl.config.schema import RunConfig
from megatron_rl.platform import collectives, watchdog
from megatron_rl.rollout.client import WeightsNeeded

if TYPE_CHECKING:
    from megatron_rl.rollout import GeneratorPool, PushStats
    from megatron_rl.trainer.setup import Run

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Reweigh:
    """The main rank's answer instead of a value (``on_every_rank``): restarted engines wait
    for the weights of ``version``; every rank streams them, then the main rank asks again."""

    version: int


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
    pool: GeneratorPool | None,
    main: bool,
    make: Callable[[], T],
    wait: collectives.RankZeroWait | None = None,
    share: bool = True,
) -> T | None:
    """``make()`` on the main rank (it drives the pool), broadcast to every rank (``share``;
    else it stays on the main rank and the others get None). While the main rank waits on
    the pool, restarted engines may wait for the current weights (elastic engines,
    ``WeightsNeeded``): then every rank streams the weights again into those engines (a
    collective, like a push), and ``make`` is called again (it resumes). The other ranks
    wait under ``wait`` (a batch's or a validation pass's bound; None: the world's)."""
    broadcast = wait.broadcast_object if wait is not None else collectives.broadcast_object
    while True:
        value = _or_reweigh(make, pool) if main else None
        # The other ranks wait here for the main rank's long work (a batch, validation), under
        # its own bound (``wait``); the main rank is judged meanwhile (its waits on the pool
        # beat), and so is its wait here for another rank that stopped.
        waiting = (
            watchdog.paused("waiting for the main rank") if not main else contextlib.nullcontext()
        )
        with waiting:
            # unshared values: a reweigh, or an error (a RewardFailure, a validation given
            # up on a stop), which every rank raises
            unshared = isinstance(value, (Reweigh, Exception))
            sent = broadcast(value if share or unshared else None)
        if not isinstance(sent, Reweigh):
            return value if main else sent
        push_weights(run, pool, reweigh=True)


def _or_reweigh(make: Callable[[], T], pool: GeneratorPool) -> T | Reweigh:
    try:
        return make()
    except WeightsNeeded:
        logger.info("re-sending the weights of version %d to restarted engines", pool.version)
        return Reweigh(pool.version)


def push_weights(
    run: Run,
    pool: GeneratorPool | None,
    reweigh: bool = False,
    between: Callable[[], None] | None = None,
) -> PushStats | None:
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

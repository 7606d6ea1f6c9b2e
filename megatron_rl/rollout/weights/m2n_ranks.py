"""``nccl_m2n`` on every source rank: who joins the engines' communicators and sends, when.

m2n's reshard is collective over a communicator of the trainer's source ranks ``[0, A)``
(:mod:`.m2n`: ``A = max(TP, EP)``) and one engine's workers, so every source rank must join
each engine's communicator and run every reshard, in the same order, with its own blocks. The
pool lives on rank 0 only; the other source ranks follow it through commands that rank 0
broadcasts on a gloo group of the source ranks (:class:`SourceRanks`):

- ``Form``: join these communicators (one per engine, in order), leaving the ones joined
  before: sent by the pool's opener (:func:`open_sender`) whenever the pool forms its group
  transport, i.e. when it starts and when a push or reweigh goes to other engines than the
  group's (a death, a restart);
- ``Send``: reshard this bucket's names into every engine's communicator: sent by rank 0's
  sender for each bucket of a push (rank 0 announces each bucket's names to the engines
  through the pool, ``update_payload``);
- ``End``: the pool's start, or the push, is over (``Abort``: it failed on rank 0).

The other source ranks listen exactly when rank 0's pool may form or push: around the pool's
start (:func:`serving`, where they used to wait on a barrier) and inside
``push_megatron_weights``, which every trainer rank calls for a push and for a reweigh
(:meth:`SourceRanks.push`; they return when rank 0's push has returned, so their next
optimizer step cannot change blocks still being sent). A pool that forms its transport at
any other time (``GeneratorPool(wait=False)``) is refused by the opener: the others would
not hear it. Data-parallel replicas (ranks ``>= A``) hold copies and take no part; none of
the ranks streams HF buckets (``iter_hf_weights``) for this transport.

Rank 0 closes its ends when the pool closes or re-forms (locally: the others may be
anywhere then); the others close theirs when told to form again, or at exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.platform import collectives, watchdog

logger = logging.getLogger(__name__)

KEY = "rollout.weight_transport"
ABORT_WAIT_SECONDS = 5.0  # rank 0 tells the others it failed, unless they are stuck


@dataclass(frozen=True)
class Form:
    infos: list[Any]  # M2NTrainerInitInfo per engine, in order (rank 0's: rank 0)


@dataclass(frozen=True)
class Send:
    names: list[str]  # one bucket, in send order


@dataclass(frozen=True)
class End:
    pass


@dataclass(frozen=True)
class Abort:
    pass


_current: SourceRanks | None = None


def current() -> SourceRanks | None:
    """This rank's part in ``nccl_m2n`` pushes, once :func:`serving` set it up; else None."""
    return _current


class SourceRanks:
    """One trainer rank's part: ``layout`` (None: a data-parallel replica), its ``source``
    (:class:`~.m2n.MegatronM2NSource`), ``group``: the gloo group of the source ranks (None
    with one source rank), ``device``: where its blocks are (the reshard's thread device)."""

    def __init__(
        self,
        layout: Any,
        source: Any,
        group: Any,
        device: torch.device,
        timeout_minutes: float,
    ) -> None:
        self.layout, self.source, self.group, self.device = layout, source, group, device
        self.timeout_minutes = timeout_minutes
        self.engines: list[Any] = []  # a follower's trainer engines, one per communicator
        self.listening = False  # rank 0: the others wait for its commands now
        self.broken = False  # rank 0 failed while they may have been in a collective

    @property
    def leader(self) -> bool:
        return self.layout is not None and self.layout.rank == 0

    # -- the channel --------------------------------------------------------------------------
    def _exchange(self, command: Any) -> Any:
        """Rank 0's ``command`` on every source rank (None when there is one)."""
        if self.group is None:
            return command
        try:
            return collectives.broadcast_object(command, src=0, group=self.group)
        except RuntimeError as err:
            raise TimeoutError(
                f"nccl_m2n: source rank {self.layout.rank}: no command from rank 0 within "
                f"{self.timeout_minutes:g} min (the longer of rollout.startup_timeout_minutes "
                f"and rollout.push_timeout_seconds), or rank 0 failed: {err}"
            ) from err

    def tell(self, command: Any) -> None:
        """Rank 0: send ``command`` to the other source ranks (they must be listening)."""
        assert self.leader, "only rank 0 commands the source ranks"
        if self.broken:
            raise RuntimeError("nccl_m2n: a previous push failed; the source ranks are gone")
        self._exchange(command)

    def _abort(self) -> None:
        """Tell the others that rank 0 failed, unless they are stuck in a collective with the
        engines (then they fail by their own timeout, or when this process exits)."""
        import threading

        self.broken = True
        if self.group is None:
            return
        teller = threading.Thread(target=self._exchange, args=(Abort(),), daemon=True)
        teller.start()
        teller.join(ABORT_WAIT_SECONDS)

    @contextlib.contextmanager
    def leading(self) -> Iterator[None]:
        """Rank 0: the others listen while the body runs, then hear ``End`` (``Abort``)."""
        self.listening = True
        try:
            yield
        except BaseException:
            self.listening = False
            self._abort()
            raise
        self.listening = False
        self.tell(End())

    def serve(self, what: str) -> None:
        """A source rank other than 0: run rank 0's commands until ``End``."""
        while True:
            with watchdog.paused(f"nccl_m2n: following rank 0 through {what}"):
                command = self._exchange(None)
            watchdog.beat(f"nccl_m2n: {type(command).__name__} in {what}")
            if isinstance(command, End):
                return
            if isinstance(command, Abort):
                raise RuntimeError(f"nccl_m2n: rank 0 failed during {what} (see its log)")
            if isinstance(command, Form):
                self.join(command.infos)
            elif isinstance(command, Send):
                from megatron_rl.rollout.weights.m2n import send_blocks

                blocks = self.source.blocks(command.names)
                for engine in self.engines:
                    send_blocks(engine, blocks)
            else:
                raise RuntimeError(f"nccl_m2n: unknown command {command!r} from rank 0")

    def join(self, infos: Sequence[Any]) -> None:
        """Leave the communicators joined before, join those of ``infos`` as this rank."""
        from megatron_rl.rollout.weights.m2n import start_trainer_engine

        self.close()
        for info in infos:
            mine = dataclasses.replace(info, rank=self.layout.rank)
            self.engines.append(start_trainer_engine(self.source, mine, client=None))

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        self.engines = []

    # -- a push -------------------------------------------------------------------------------
    def push(self, pool: Any, reweigh: bool, between: Callable[[], None] | None) -> Any:
        """This rank's part of a push (``reweigh``: see ``GeneratorPool.reweigh``): rank 0
        pushes its blocks through ``pool`` while the other source ranks follow; replicas
        return at once. Returns the push statistics on rank 0 (its own blocks' bytes)."""
        if self.layout is None:
            return None
        if not self.leader:
            self.serve("a weight push")
            return None
        if pool is None:
            raise ValueError("nccl_m2n: rank 0 pushes through the generator pool; got None")
        with self.leading():
            buckets = self.buckets(pool.config.weight_bucket_bytes)
            if reweigh:
                return pool.reweigh(buckets)
            return pool.push_weights(buckets, between=between)

    def buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """This rank's blocks, in the source's order, in buckets of at least
        ``bucket_bytes`` (one made at a time: Llama-4's expert stacks are copies)."""
        bucket, size = [], 0
        for name, block in self.source:
            bucket.append((name, block.detach()))
            size += block.numel() * block.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


class M2NSender:
    """Rank 0's end of the engines' communicators, a
    :class:`~megatron_rl.rollout.weights.buckets.WeightSender`: ``connect`` joins each
    (vLLM's trainer engine; the engine joins on the pool's ``JoinTransport``), ``pack``
    announces a bucket's names to every engine, ``send`` has every source rank reshard it
    into each engine's communicator in turn."""

    blocking = True  # returns when every engine has its blocks (the pool watches meanwhile)

    def __init__(self, ranks: SourceRanks, infos: Sequence[Any], handles: Sequence[Any]) -> None:
        self.ranks, self.infos, self.handles = ranks, list(infos), list(handles)
        self.engines: list[Any] = []

    def connect(self) -> None:
        from megatron_rl.platform import set_thread_device
        from megatron_rl.rollout.weights.m2n import start_trainer_engine

        set_thread_device(self.ranks.device)  # the pool's helper thread: this rank's GPU
        for info, handle in zip(self.infos, self.handles):
            client = _JoinClient(handle)
            self.engines.append(start_trainer_engine(self.ranks.source, info, client))
        logger.info("nccl_m2n: %d engine communicator(s) formed", len(self.engines))

    def pack(self, bucket: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        from megatron_rl.rollout.weights.m2n import update_payload

        return update_payload([name for name, _ in bucket])

    def send(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        from megatron_rl.platform import set_thread_device
        from megatron_rl.rollout.weights.m2n import send_blocks

        set_thread_device(self.ranks.device)
        self.ranks.tell(Send([name for name, _ in bucket]))
        for engine in self.engines:
            send_blocks(engine, bucket)

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        self.engines = []


class _JoinClient:
    """The part of vLLM's ``VLLMWeightSyncClient`` its trainer engine uses to start (rank 0
    only): the engine's init goes through the pool (``JoinTransport``: its runner calls
    ``init_weight_transfer_engine`` on every worker, then answers ``TransportJoined``)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from megatron_rl.rollout.messages import JoinTransport

        self.handle.send(JoinTransport(init_info))


def open_sender(config: Any, engines: Sequence[Any], wait_joined: Callable) -> M2NSender:
    """The ``nccl_m2n`` transport's opener on rank 0 (``Transport.open``): a communicator per
    engine, on fresh ports, joined by every source rank (``Form``) and the engine."""
    from megatron_rl.platform import free_port
    from megatron_rl.rollout.weights.m2n import trainer_init_info

    ranks = require_leader()
    if not ranks.listening:
        raise RuntimeError(
            f"{KEY} 'nccl_m2n': the pool formed its transport while the other source ranks "
            "were not listening (they follow rank 0 only around the pool's start and in a "
            "push: start the pool with wait=True)"
        )
    address = config.nccl_address or socket.gethostname()
    infos = [
        trainer_init_info(ranks.layout, address, free_port(), config.tensor_parallel)
        for _ in engines
    ]
    ranks.tell(Form(infos))
    sender = M2NSender(ranks, infos, engines)
    wait_joined(sender.connect)
    return sender


def require_leader() -> SourceRanks:
    """Rank 0's :class:`SourceRanks`, or a ``ValueError`` naming the recipe key."""
    ranks = current()
    if ranks is None or not ranks.leader:
        raise ValueError(
            f"{KEY} 'nccl_m2n': this pool has no trainer source ranks to send with (the "
            "trainer sets them up around the pool's start: m2n_ranks.serving, on trainer "
            "rank 0)"
        )
    return ranks


@contextlib.contextmanager
def serving(model: Any, config: Any) -> Iterator[SourceRanks | None]:
    """Around the pool's start on every trainer rank (``config``: the run's rollout config):
    with ``nccl_m2n``, set up this rank's :class:`SourceRanks` (a collective: every rank
    enters) and, on source ranks other than 0, follow rank 0 while its pool starts and forms
    its transport; otherwise nothing (and no source ranks: pushes stream HF buckets)."""
    global _current
    if _current is not None:
        _current.close()
    _current = None
    if config.weight_transport != "nccl_m2n":
        yield None
        return
    _current = ranks = _activate(model, config)
    if ranks.leader:
        with ranks.leading():
            yield ranks
        return
    if ranks.layout is not None:
        ranks.serve("the generator pool's start")
    yield ranks


def _activate(model: Any, config: Any) -> SourceRanks:
    from megatron.core import parallel_state as ps

    from megatron_rl.rollout.weights.m2n import MegatronM2NSource, megatron_source_layout

    layout = megatron_source_layout()  # refuses layouts m2n cannot describe, on every rank
    size = max(ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
    timeout = max(config.startup_timeout_minutes, config.push_timeout_seconds / 60)
    group = collectives.timed_group(timeout, ranks=list(range(size))) if size > 1 else None
    source = None
    if layout is not None:
        source = MegatronM2NSource(model, layout, model.architecture.hf_architecture)
    device = next(model.parameters()).device
    return SourceRanks(layout, source, group, device, timeout)

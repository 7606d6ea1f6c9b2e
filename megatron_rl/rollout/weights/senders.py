"""The weight transports (``rollout.weight_transport``), chosen once per pool.

A :class:`Transport` says what both ends of one transport need: the vLLM weight-transfer
backend the engines build, whether they join it when built or when the pool says so (a group
of fixed members, which the pool forms anew when they change: ``WeightPusher.form``), and
how the pool opens its sender end (a
:class:`~megatron_rl.rollout.weights.buckets.WeightSender`). ``TRANSPORTS`` holds three: ``host``
(buckets through host memory, :class:`~megatron_rl.rollout.weights.buckets.HostSender`), ``nccl``
(one broadcast from the trainer, :class:`~megatron_rl.rollout.weights.nccl.NcclSender`) and
``nccl_m2n`` (every trainer source rank sends its own shards, :mod:`megatron_rl.rollout.weights.m2n`,
following rank 0's pool: :mod:`megatron_rl.rollout.weights.m2n_ranks`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.messages import JoinTransport
from megatron_rl.rollout.weights.buckets import CPU_BACKEND, HostSender, WeightSender
from megatron_rl.rollout.weights.experts import engine_placement
from megatron_rl.rollout.weights.nccl import engine_backend

# open(config, hf text config, engines (EngineHandle), wait_joined) -> the sender end;
# ``wait_joined(connect)`` runs ``connect`` (the sender's side of a group's rendezvous, which
# blocks until every member joined) while the pool watches the engines, then returns once
# every engine has answered JoinTransport (TransportJoined).
WaitJoined = Callable[[Callable[[], None] | None], None]
Opener = Callable[[RolloutConfig, Any, Sequence[Any], WaitJoined], WeightSender]


@dataclass(frozen=True)
class Transport:
    name: str
    backend: Callable[[RolloutConfig], str]  # the vLLM weight-transfer backend of the engines
    # the engine joins when built; else on the pool's JoinTransport, as a member of a group
    # that the pool forms of the engines a push goes to (after a death, of them anew)
    joins_at_build: bool
    open: Opener
    # raises (naming the recipe key) when this machine cannot run the transport: the pool
    # calls it before it starts any engine
    check: Callable[[RolloutConfig], None] = lambda config: None


def _open_host(config: RolloutConfig, hf_config: Any, engines, wait_joined) -> WeightSender:
    experts = engine_placement(config, hf_config)  # rollout.expert_parallel
    return HostSender(config.placement, experts)


def _open_nccl(config: RolloutConfig, hf_config: Any, engines, wait_joined) -> WeightSender:
    """Form an NCCL weight-transfer group of ``engines`` (all of the pool's, or those a push
    goes to after a death): their workers (each leaves its previous group first:
    ``VLLMEngine.init_transport``), then this sender, on fresh ports."""
    from megatron_rl.platform import free_port, get_platform
    from megatron_rl.rollout.weights.nccl import NcclSender, group_layout, worker_payloads

    if not get_platform().is_gpu:
        raise ValueError("rollout.weight_transport 'nccl' needs GPUs; this machine has none")
    address = config.nccl_address or socket.gethostname()
    port = free_port()
    experts = engine_placement(config, hf_config)  # rollout.expert_parallel: EP groups
    expert_ports = [free_port() for _ in range(experts.ep_size if experts else 0)]
    tp, bucket = config.tensor_parallel, config.weight_bucket_bytes
    payloads = worker_payloads(address, port, expert_ports, len(engines), tp, bucket)
    for engine, payload in zip(engines, payloads):
        engine.send(JoinTransport(payload))
    world, _ = group_layout(len(engines), tp)
    sender = NcclSender(address, port, world, bucket, experts=experts, expert_ports=expert_ports)
    wait_joined(sender.connect)  # connect returns when every worker has joined
    return sender


def _check_m2n(config: RolloutConfig) -> None:
    """vLLM's ``nccl_m2n``: GPUs, the ``nccl.m2n`` runtime, and the trainer's source ranks
    on this rank (``m2n_ranks.serving``); errors name the key."""
    from megatron_rl.platform import get_platform
    from megatron_rl.rollout.weights.m2n import require_runtime
    from megatron_rl.rollout.weights.m2n_ranks import require_leader

    if not get_platform().is_gpu:
        raise ValueError("rollout.weight_transport 'nccl_m2n' needs GPUs; this machine has none")
    require_runtime()
    require_leader()


def _open_m2n(config: RolloutConfig, hf_config: Any, engines, wait_joined) -> WeightSender:
    """A communicator per engine, joined by every trainer source rank (they follow rank 0's
    pool: :func:`~megatron_rl.rollout.weights.m2n_ranks.open_sender`)."""
    from megatron_rl.rollout.weights.m2n_ranks import open_sender

    _check_m2n(config)
    return open_sender(config, engines, wait_joined)


TRANSPORTS: dict[str, Transport] = {
    "host": Transport("host", lambda config: CPU_BACKEND, True, _open_host),
    # an NCCL group has a fixed set of ranks: a dead one blocks every later broadcast
    "nccl": Transport(
        "nccl", lambda config: engine_backend(config.expert_parallel), False, _open_nccl
    ),
    # vLLM's own engine (its fallback load_weights places experts on EP engines), one group
    # per engine (vLLM ranks a worker by its place in its own engine): see m2n.py
    "nccl_m2n": Transport("nccl_m2n", lambda config: "nccl_m2n", False, _open_m2n, _check_m2n),
}


def transport_for(config: RolloutConfig) -> Transport:
    """The transport of a resolved config (``RolloutConfig.resolved``: no "auto" left)."""
    try:
        return TRANSPORTS[config.weight_transport]
    except KeyError:
        raise ValueError(
            f"rollout.weight_transport {config.weight_transport!r}: expected one of "
            f"{sorted(TRANSPORTS)} (resolve 'auto' with RolloutConfig.resolved first)"
        ) from None

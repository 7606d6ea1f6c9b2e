"""The generator pool: N vLLM engines, requests spread over them, in-flight weight pushes.

Typical use (PipelineRL)::

    pool = GeneratorPool(hf_dir, RolloutConfig(...), encode=tokenizer_encode)
    pool.submit(prompts)                       # generation starts, in the background
    samples = pool.poll(timeout=1.0)           # finished samples, as they come
    pool.push_weights(iter_hf_weights(model))  # engines keep their requests in flight
    pool.close()

``generate(prompts)`` is the blocking form. The pool is driven from one thread; the engines
run on their own threads (``placement: in_process``), processes (``subprocess``) or tasks
that connect over TCP (``remote``, see :mod:`megatron_rl.rollout.pool.remote`); all of them
run :func:`megatron_rl.rollout.engine.runner.run_engine`, and the pool reaches each through
an :class:`~megatron_rl.rollout.pool.launchers.EngineHandle` (commands and events:
:mod:`megatron_rl.rollout.messages`; weights: the transport's
:class:`~megatron_rl.rollout.weights.buckets.WeightSender`, chosen once:
:mod:`megatron_rl.rollout.weights.senders`).

The pool is a front over three collaborators that do not know each other:
:class:`~.supervisor.EngineSupervisor` (the engines: events, deaths and stalls, restarts: an
engine is cattle), :class:`~.requests.RequestBook` (which engine holds which request, to
resubmit a dead engine's exactly as submitted) and :class:`~.pusher.WeightPusher` (the
transport's sender end, its group, a push's phases); its
:class:`~.scheduler.RequestScheduler` hands requests to the engines over the first two. A
restarted engine takes requests once it runs the current policy version: at the next
``push_weights``, or earlier by ``reweigh`` (the trainer re-sends its weights to that engine
only; the pool keeps no copy of them). Every token thus still carries a known version.

Modules: :mod:`.generator_pool` (the front), :mod:`.supervisor`, :mod:`.requests`,
:mod:`.pusher` (its collaborators), :mod:`.scheduler` (requests to engines),
:mod:`.launchers` (an engine handle and launcher per placement), :mod:`.remote` (the pool's
end of remote engines) and :mod:`.listener` (its listening socket), :mod:`.fanout` (a push's
buckets to every engine at once), :mod:`.restarts` (how often an engine may be restarted).
"""

from megatron_rl.rollout.pool.generator_pool import GeneratorPool

__all__ = ["GeneratorPool"]

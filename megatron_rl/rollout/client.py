"""What the trainer needs of a rollout pool, whichever runs it (imports no torch).

:class:`RolloutClient` is the interface of :class:`~megatron_rl.rollout.pool.GeneratorPool`
(vLLM engines) and of the simulator's :class:`~megatron_rl.simulation.engines.EmulatedPool`
that the trainer's :class:`~megatron_rl.trainer.rollout_source.RolloutSource` and the loop
call: requests in (``submit``), samples out (``poll``), the policy ``version``, weights
(``push_weights``, and ``reweigh`` when restarted engines ``needs_weights``) and the engines'
load (``engine_idle_fractions`` since ``reset_engine_load``). A pool whose engines never
restart, or that does not keep per-engine load, may inherit the defaults here.

:class:`WeightsNeeded` is raised to the trainer loop when restarted engines wait for the
current weights, which only the trainer can send (all its ranks stream them together).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from megatron_rl.rollout.samples import PushStats, Sample

if TYPE_CHECKING:
    from megatron_rl.conversion.weight_stream import WeightBucket


class WeightsNeeded(Exception):
    """Restarted engines are ready and wait for the current weights
    (``GeneratorPool.reweigh``); raised where waiting for samples could otherwise last
    until the next regular push (forever, when no engine runs the current weights)."""


class GenerationStopped(Exception):
    """``generate`` gave up on its caller's request (``stop_when``): its requests were
    cancelled in every engine; nothing of them is returned, now or later."""


@runtime_checkable
class RolloutClient(Protocol):
    """A pool of generators as the trainer drives it (see the module docstring)."""

    version: int  # the policy version of the newest weights (the number of pushes so far)

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        samples_per_prompt: int | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seeds: Sequence[int] | None = None,
        problems: Sequence[Any] | None = None,
    ) -> list[int]:
        """Queue ``samples_per_prompt`` samples of every prompt (token ids); returns the
        prompts' indices (``Sample.prompt_index``). ``seeds``: one per prompt; ``problems``:
        one per prompt, the samples are multi-turn episodes on them."""
        ...

    def poll(self, timeout: float = 0.0) -> list[Sample]:
        """Finished samples not returned yet, waiting up to ``timeout`` s for the first."""
        ...

    def push_weights(
        self,
        buckets: Iterable[WeightBucket],
        kv_on_push: str | None = None,
        between: Callable[[], None] | None = None,
    ) -> PushStats:
        """Load new weights into every engine (requests in flight are kept) and advance
        ``version``; ``between`` is called whenever the push waits."""
        ...

    def needs_weights(self) -> bool:
        """Whether a restarted engine waits for the current weights (:meth:`reweigh`)."""
        return False

    def reweigh(self, buckets: Iterable[WeightBucket]) -> PushStats:
        """Load the current weights into the engines that wait for them."""
        ...

    def reset_engine_load(self) -> None:
        """Start a new window for :meth:`engine_idle_fractions`."""

    def engine_idle_fractions(self) -> list[float]:
        """Per engine, the fraction of the window with no request generating (an episode
        that waits on a tool call is not; [] when the pool does not keep it)."""
        return []

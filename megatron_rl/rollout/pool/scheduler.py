"""The pool's scheduling: which engine takes which request.

A prompt's requests go together to the least loaded engine (by requests held) that runs the
pool's current policy version (``EngineRecord.current``). When none does (every engine was
restarted and waits for the weights) they wait in the request book, and are resubmitted, a
prompt's samples together and in their order, once an engine runs the current weights again
(after a push or a reweigh) or an engine's requests are withdrawn (it died). The scheduler
keeps no state of its own: it works on the supervisor's engine records and the pool's
:class:`~megatron_rl.rollout.pool.requests.RequestBook`, which the pool hands it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from megatron_rl.rollout.messages import RequestSpec, Submit
from megatron_rl.rollout.pool.requests import check_prompt

if TYPE_CHECKING:
    from megatron_rl.rollout.pool.requests import RequestBook, Sampling
    from megatron_rl.rollout.pool.supervisor import EngineSupervisor


class RequestScheduler:
    """Requests to engines (see the module docstring); driven from the pool's thread.

    ``vocab_size``: the model's, to check prompts against; ``version``: the pool's policy
    version now (recorded as the oldest in flight of an engine given its first request)."""

    def __init__(
        self,
        engines: EngineSupervisor,
        requests: RequestBook,
        vocab_size: int,
        version: Callable[[], int],
    ) -> None:
        self._engines = engines
        self._requests = requests
        self._vocab_size = vocab_size
        self._version = version

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sampling,
        seeds: Sequence[int] | None,
        problems: Sequence[Any] | None = None,
    ) -> list[int]:
        """Book and hand out ``sampling.samples_per_prompt`` requests of every prompt (token
        ids, checked), seeded by ``seeds`` (one per prompt) if given, episodes on
        ``problems`` (one per prompt) if given; returns the prompts' indices."""
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if problems is not None and len(problems) != len(prompts):
            raise ValueError(f"{len(problems)} problems for {len(prompts)} prompts")
        limit = min(e.max_model_len for e in self._engines.engines)
        indices = []
        for p, prompt in enumerate(prompts):
            ids = check_prompt(prompt, self._vocab_size, limit)
            specs = self._requests.new_prompt(
                ids,
                sampling,
                None if seeds is None else seeds[p],
                None if problems is None else problems[p],
            )
            self.assign(specs)
            indices.append(specs[0].prompt_index)
        return indices

    def assign(self, specs: list[RequestSpec]) -> None:
        """Hand one prompt's requests to the least loaded engine that runs the current
        weights; without one they wait in the book (see :meth:`resubmit`)."""
        usable = [e.index for e in self._engines.engines if e.current]
        index = self._requests.least_loaded(usable)
        if index is None:
            self._requests.wait(specs)
            return
        engine = self._engines.engines[index]
        engine.handle.send(Submit(tuple(specs)))
        self._requests.hold(index, specs)
        if engine.oldest is None:
            engine.oldest = self._version()

    def resubmit(self) -> None:
        """Hand out the waiting requests again, a prompt's samples together, in their order."""
        for specs in self._requests.take_pending():
            self.assign(specs)

    def oldest_version_in_flight(self) -> int | None:
        """The oldest policy version that produced a token still in flight, as the engines
        last reported it (None when no engine holds a request)."""
        versions = [
            e.oldest
            for e in self._engines.engines
            if self._requests.outstanding(e.index) and e.oldest is not None
        ]
        return min(versions, default=None)

"""Every message between the generator pool and its engines, as frozen dataclasses.

They cross thread queues (``placement: in_process``), an engine process's pipe
(``subprocess``, framed by :mod:`megatron_rl.rollout.wire`) and a TCP connection
(``remote``, :mod:`megatron_rl.rollout.wire`): all of them pickle (plain fields, slots),
and a sample list is carried as is, never copied into another form.

- Commands (pool -> engine): :class:`Submit`, :class:`Cancel`, :class:`Push`,
  :class:`AskStatus`, :class:`JoinTransport`, :class:`Stop`.
- Events (engine -> pool): :class:`Ready`, :class:`SamplesDone`, :class:`ToolWaits`,
  :class:`Pushed`, :class:`StatusReport`, :class:`TransportJoined`, :class:`Failed`,
  :class:`Stopped`, :class:`Alive` (an engine process's beat: ``rollout.engine_stall_timeout``).
  ``engine`` is the engine's index in the pool; ``oldest`` the oldest policy version still
  in flight on it (None when it is idle).
- The remote wire adds what a connection needs around them (:class:`Hello`, :class:`Init`,
  :class:`Reject`, :class:`Heartbeat`, :class:`BucketBytes`, :class:`BucketHeader`,
  :class:`WeightsEnd`).

A push's buckets do not travel as messages: the engine's weights queue gets the packed
bucket itself (:class:`~megatron_rl.rollout.weights.buckets.WeightSender`), then None at its end.
This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from megatron_rl.rollout.samples import Sample

_message = dataclass(frozen=True, slots=True)


@_message
class RequestSpec:
    """One sample to generate; ``budget``: its thinking budget (None: no interruption)."""

    prompt_index: int
    sample_index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    temperature: float
    top_p: float
    budget: int | None = None
    seed: int | None = None  # sampling seed: the same request draws the same tokens anywhere
    # A multi-turn episode's problem (``data.prompts.Prompt``: its environment resets on it);
    # None: a single-turn sample, even on an engine that runs episodes.
    problem: Any = None


@_message
class RunnerSettings:
    """What every request of an engine shares."""

    stop_token_ids: tuple[int, ...]
    text_ids: tuple[int, ...] = ()  # interruption text
    close_ids: tuple[int, ...] = ()  # think-close marker
    answer_budget: int = 0
    # Multi-turn episodes (``rollout.max_turns`` > 1): the run's ``reward`` section
    # (``rewards.config.RewardConfig``), whose sandbox settings the tool's programs run under.
    sandbox: Any = None


# -- commands: pool -> engine ---------------------------------------------------------------


@_message
class Submit:
    """Start generating these requests."""

    specs: tuple[RequestSpec, ...]


@_message
class Cancel:
    """Drop every request of these prompts (``RequestSpec.prompt_index``): the pool gave
    them up (a validation abandoned on a stop); nothing of theirs is sent back."""

    prompts: tuple[int, ...]


@_message
class Push:
    """Load the buckets that follow in the weights queue (up to None) as ``version``; the
    engine generates until the first one arrives."""

    version: int
    kv_on_push: str  # "keep" or "recompute"


@_message
class AskStatus:
    """Answer with a :class:`StatusReport` between two engine steps."""


@_message
class JoinTransport:
    """Join the weight-transfer group (``init_info``: vLLM's worker init payload)."""

    init_info: dict[str, Any]


@_message
class Stop:
    """Close the engine and end its loop (requests in flight are dropped)."""


Command = Union[Submit, Cancel, Push, AskStatus, JoinTransport, Stop]


# -- events: engine -> pool -----------------------------------------------------------------


@_message
class Ready:
    engine: int
    max_model_len: int
    pid: int | None = None


@_message
class SamplesDone:
    engine: int
    samples: list[Sample]
    oldest: int | None


@_message
class ToolWaits:
    """``waiting``: how many of the engine's episodes wait on a tool call now (sent when it
    changes, before the samples of the same step): their requests are held, not generating;
    the pool leaves them out of the engine's busy time."""

    engine: int
    waiting: int


@_message
class Pushed:
    """The push of ``version`` is loaded; generation was paused ``seconds``."""

    engine: int
    version: int
    seconds: float
    tensors: int
    nbytes: int
    oldest: int | None


@_message
class StatusReport:
    """``status``: ``version``, ``requests`` and ``tokens`` in flight, ``oldest_version``."""

    engine: int
    status: dict[str, Any]


@_message
class TransportJoined:
    engine: int


@_message
class Failed:
    engine: int
    traceback: str


@_message
class Stopped:
    engine: int


@_message
class Alive:
    """An engine process runs (sent by a thread of its own every few seconds, whatever its
    loop does); ``step_seconds``: how long its loop has been inside one engine step (0 when
    it is not stepping: idle, or loading weights)."""

    engine: int
    step_seconds: float


Event = Union[
    Ready, SamplesDone, ToolWaits, Pushed, StatusReport, TransportJoined, Failed, Stopped, Alive
]
EVENTS: tuple[type, ...] = (
    Ready, SamplesDone, ToolWaits, Pushed, StatusReport, TransportJoined, Failed, Stopped, Alive,
)  # fmt: skip


def unknown_message(message: Any, where: str) -> TypeError:
    """The error for a message of no known type (a protocol mismatch between two ends)."""
    return TypeError(
        f"{where}: unknown message {type(message).__module__}.{type(message).__qualname__} "
        f"({message!r:.200}); both ends must run the same megatron_rl.rollout.messages"
    )


# -- the remote wire: around commands and events on a TCP connection ------------------------


@_message
class Hello:
    """An engine task's first message: its index and where it runs (host, pid)."""

    engine: int
    peer: dict[str, Any]


@_message
class Init:
    """The pool's answer to :class:`Hello`: what the engine is built from."""

    hf_dir: str
    config: Any  # RolloutConfig
    settings: RunnerSettings | None


@_message
class Reject:
    reason: str


@_message
class Heartbeat:
    """An engine task is alive (sent while nothing else is)."""


@_message
class BucketBytes:
    """A bucket's layout (:class:`~megatron_rl.rollout.weights.buckets.FlatBucket` header); its raw
    tensor bytes follow as one frame per non-empty tensor."""

    header: dict[str, Any]


@_message
class BucketHeader:
    """A bucket announced only (its tensors come by NCCL broadcast: ``rollout.nccl``)."""

    info: dict[str, Any]


@_message
class WeightsEnd:
    """The push's last bucket was sent."""

"""What the generator returns (plain Python data: cheap to pass between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The version of a token no policy produced (a tool's output appended to a multi-turn
# episode): the lag bound and the staleness metrics skip it.
TOOL_VERSION = -1


@dataclass
class Sample:
    """One generated response.

    Per-token lists all have the response's length ``T``:
    ``logprobs [T]``: the generator's log-prob of each token (0.0 on appended tokens);
    ``versions [T]``: the policy version whose weights produced each token (for appended
    tokens: the version current when they were appended);
    ``mask [T]``: True where the policy generated the token, False on the interruption text
    appended by the generator (no loss there).

    ``finish_reason``: "stop" (a stop token, included in ``response_ids``), "length" (a token
    budget ran out) or "abort". ``interrupted``: the thinking budget was hit and the
    interruption text appended. ``thinking_budget``: the budget drawn for this sample (None
    without interruptions).

    ``routed_experts [P, layers, topk]`` (engines that return them, MoE models): the experts
    position ``p`` of ``prompt_ids + response_ids`` was routed to in every layer when the
    generator processed it (``megatron_rl.rollout.engine.routing``); ``P`` is at most the sequence
    length (the last token is never processed). An interrupted sample's rows are those of its
    first request up to the cut, then those of the answer request.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    finish_reason: str = ""
    interrupted: bool = False
    thinking_budget: int | None = None
    engine: int = -1
    routed_experts: np.ndarray | None = None
    # A multi-turn episode's tool calls, in order: (outcome, seconds), outcome one of
    # ``environments.protocol.OUTCOMES`` (the step's tool metrics).
    tools: list[tuple[str, float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version that produced a token of this sample (tool tokens,
        ``TOOL_VERSION``, are skipped)."""
        return min(self.model_versions(), default=None)

    @property
    def newest_version(self) -> int | None:
        """The newest policy version that produced a token of this sample."""
        return max(self.model_versions(), default=None)

    def model_versions(self) -> list[int]:
        """The versions of the tokens a policy produced (tool tokens left out)."""
        return [v for v in self.versions if v != TOOL_VERSION]

    def append_tool(self, token_ids: list[int]) -> None:
        """Append a tool's output, by id: no loss (mask False), log-prob 0, no version."""
        self.response_ids.extend(token_ids)
        self.logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([TOOL_VERSION] * len(token_ids))
        self.mask.extend([False] * len(token_ids))

    def append(self, token_ids: list[int], logprobs: list[float], version: int, mask: bool) -> None:
        """Append tokens that share a version and a mask value."""
        assert len(token_ids) == len(logprobs)
        self.response_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(token_ids))
        self.mask.extend([mask] * len(token_ids))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` response tokens."""
        del self.response_ids[length:], self.logprobs[length:]
        del self.versions[length:], self.mask[length:]
        if self.routed_experts is not None:
            self.routed_experts = self.routed_experts[: len(self.prompt_ids) + length]

    def add_routed_experts(self, rows: np.ndarray | None) -> None:
        """Add a request's routed-expert rows (from position 0): positions this sample has
        rows for keep them (the routing they were generated with), later ones are appended."""
        from megatron_rl.rollout.engine.routing import merge_rows

        self.routed_experts = merge_rows(self.routed_experts, rows)


@dataclass(frozen=True)
class PushStats:
    """One weight push into every engine of the pool."""

    version: int
    tensors: int
    bytes: int
    buckets: int
    seconds: float  # wall time of the push, from the first bucket to the last engine's ack
    load_seconds: float  # slowest engine: time spent loading (generation paused)

    @property
    def gb_per_second(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9

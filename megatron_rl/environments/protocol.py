"""The environment protocol: ``reset(problem) -> observation``, ``step(call) -> (result,
done)``, ``reward(episode)``.

One ``Environment`` object per episode (they are cheap; many episodes are in flight at once
and their steps run concurrently on the tool threads, ``tools.ToolExecutor``). The episode
itself (``Episode``: the model's and the tool's turns, each with the exact token ids the
engine produced or was given) belongs to the rollout loop; the environment reads it only to
score it.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.formats import ToolCall
from megatron_rl.rewards.config import RewardConfig

if TYPE_CHECKING:
    from megatron_rl.rewards.pool import RewardPool

logger = logging.getLogger(__name__)

# How a tool call ended: ran and returned (ok), ran and failed or could not run (error:
# an exception, a non-zero exit, a malformed call, no calls left), was stopped at its time
# limit (timeout), or wrote more than the output limits and was cut (truncated).
OUTCOMES: tuple[str, ...] = ("ok", "error", "timeout", "truncated")


@dataclass(frozen=True)
class ToolResult:
    """One tool call's result: ``outcome`` (one of ``OUTCOMES``), ``output`` (the text the
    model is shown, already cut to the token limit), ``seconds`` it took."""

    outcome: str
    output: str
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")


@dataclass
class Turn:
    """One segment of an episode: the model's generation or the tool's appended output.

    ``token_ids``: exactly the ids the engine produced (model) or was given (tool, tokenized
    once); ``text``: their decoding with special tokens (model) or the rendered observation
    (tool). Tool turns carry their ``result``.
    """

    role: Literal["model", "tool"]
    token_ids: list[int]
    text: str
    result: ToolResult | None = None


@dataclass
class Episode:
    """A problem and its turns, in order (after the prompt)."""

    problem: Any
    turns: list[Turn] = field(default_factory=list)

    def model_text(self) -> str:
        """The model's turns joined, without any tool output (what the reward reads: a tool
        that prints ``\\boxed{}`` cannot answer for the model)."""
        return "".join(t.text for t in self.turns if t.role == "model")

    def token_ids(self) -> list[int]:
        """The episode's ids after the prompt, every turn in order: ``[T]``."""
        return [i for turn in self.turns for i in turn.token_ids]

    def loss_mask(self) -> list[bool]:
        """``[T]``: True on the model's tokens, False on the tool's (no loss there)."""
        return [turn.role == "model" for turn in self.turns for _ in turn.token_ids]

    @property
    def tool_results(self) -> list[ToolResult]:
        """The results of the episode's tool calls, in order."""
        return [t.result for t in self.turns if t.role == "tool" and t.result is not None]


@dataclass(frozen=True)
class RewardRequest:
    """What scores an episode, in ``RewardPool.score_batch``'s terms (so that a loop can
    score many episodes in one batch)."""

    response: str
    reference: Any
    kind: str


@dataclass
class EnvironmentContext:
    """What an environment is built with.

    Attributes:
        config: ``rollout.environment``.
        reward: the run's ``reward`` section: how answers are scored, and the sandbox
            settings (bubblewrap, sandbox uid, unsafe mode) the tool runs with.
        tokenizer: the policy's tokenizer (tool outputs are cut by its tokens).
        max_turns: ``rollout.max_turns``: an episode makes at most ``max_turns - 1`` calls.
        reward_pool: scores ``reward(episode)``; None: the module-level reward functions.
    """

    config: EnvironmentConfig
    reward: RewardConfig
    tokenizer: Any
    max_turns: int
    reward_pool: RewardPool | None = None

    def sandbox_config(self) -> RewardConfig:
        """The reward config the tool's programs run under: the run's box settings with the
        tool's limits. ``tool_timeout_s`` bounds both the program's CPU time and its wall
        time (the episode waits on the call: a program that sleeps must not hold it for the
        reward's longer wall-clock backstop)."""
        config = dataclasses.replace(
            self.reward,
            kind="code",
            code_test_timeout_s=float(self.config.tool_timeout_s),
            code_wall_timeout_s=float(self.config.tool_timeout_s),
            code_memory_mb=self.config.tool_memory_mb,
            code_max_output_bytes=self.config.tool_max_output_bytes,
        )
        config.validate()
        return config


class Environment(ABC):
    """A multi-turn environment: one object per episode.

    Subclasses implement ``reset`` and ``run`` (one well-formed call); ``step`` adds what
    every environment shares: malformed calls and calls past the turn limit are tool
    errors, and no exception of the tool ever reaches the rollout.
    """

    # The tool the model calls by name in JSON formats (Qwen's ``"name"``), and what it does.
    tool_name: ClassVar[str] = "python"
    tool_description: ClassVar[str] = (
        "Run a Python program in a sandbox (no network, no files kept between calls) and "
        "return what it prints (stdout, then stderr)."
    )

    @classmethod
    def tool_schema(cls) -> dict[str, Any]:
        """The tool as chat templates take it (``apply_chat_template(tools=[...])``, the
        OpenAI function form): one required string argument, ``code``."""
        return {
            "type": "function",
            "function": {
                "name": cls.tool_name,
                "description": cls.tool_description,
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "Python code"}},
                    "required": ["code"],
                },
            },
        }

    def __init__(self, context: EnvironmentContext) -> None:
        self.context = context
        self.problem: Any = None
        self.calls = 0

    @property
    def max_calls(self) -> int:
        """Tool calls an episode may make: one fewer than its model turns."""
        return self.context.max_turns - 1

    def reset(self, problem: Any) -> str:
        """Start an episode on ``problem`` (a ``data.prompts.Prompt``: ``problem``, ``answer``
        or ``tests``); returns the problem text the model is shown."""
        self.problem, self.calls = problem, 0
        return str(problem.problem)

    def step(self, call: ToolCall) -> tuple[ToolResult, bool]:
        """Run one tool call: its result, and whether the episode must end now (no calls
        left; the result is then not shown). Never raises."""
        if self.problem is None:
            raise RuntimeError("step before reset")
        self.calls += 1
        if self.calls > self.max_calls:
            return ToolResult("error", f"no tool calls left (at most {self.max_calls})"), True
        if call.malformed:
            return ToolResult("error", f"Error: {call.error}"), False
        try:
            return self.run(str(call.code)), False
        except Exception as exc:  # noqa: BLE001 - a tool failure is the episode's data
            logger.warning("tool %s failed: %s: %s", type(self).__name__, type(exc).__name__, exc)
            return ToolResult("error", f"Error: the tool failed ({type(exc).__name__})"), False

    @abstractmethod
    def run(self, code: str) -> ToolResult:
        """Run one well-formed call's ``code``."""

    def reward_request(self, episode: Episode) -> RewardRequest:
        """The episode's scoring: the model's text (tool output excluded) against the
        problem's reference, by the problem's reward kind."""
        problem = episode.problem
        return RewardRequest(episode.model_text(), problem.reference, problem.kind)

    def reward(self, episode: Episode) -> float:
        """The episode's reward (``RewardPool.score_batch`` of ``reward_request``)."""
        request = self.reward_request(episode)
        pool = self.context.reward_pool
        if pool is not None:
            return pool.score_batch([request.response], [request.reference], [request.kind])[0]
        if request.kind == "math":
            from megatron_rl.rewards import math

            return math.score(request.response, request.reference)
        from megatron_rl.rewards import code

        return code.score_code(request.response, request.reference, self.context.reward)

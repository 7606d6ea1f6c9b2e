"""What multi-turn episodes (``rollout.max_turns`` > 1, issue 38) change in a run's plan (no
torch import).

How the engine runner generates an episode (``megatron_rl.rollout.engine.runner``): a model
turn is one vLLM request; when it ends on the tool format's stop id, the tool's output is
appended by id and the next turn is a new request whose prompt is the whole context so far
(prompt, earlier turns, tool outputs). ``rollout.max_tokens`` is the episode's budget of model
and tool tokens together (``EngineRunner._continue_episodes`` cuts there), so:

- Memory does not grow. The longest sequence the trainer sees is prompt + the longest
  response (``RunConfig.max_response_tokens``), and a turn's request holds the KV of at most
  ``max_model_len`` tokens, exactly as single-turn; tool tokens come out of the budget.
  Episodes waiting on a tool hold no running request and no KV block of their own: their
  last turn's blocks stay in vLLM's prefix cache as long as there is room.
- Tool tokens are prefilled, never decoded: up to ``max_turns - 1`` calls x
  ``max_tool_output_tokens`` (plus each call's wrapper of a few tokens) of the budget.
- Each later turn prefills its context again. With a prefix-cache hit
  (``rollout.prefix_caching``: vLLM's ``enable_prefix_caching``) only the tool's tokens and
  the last, partial KV block of the context are computed. An episode's turns keep the
  cache salt of its first request while pushes keep the KV of older weights
  (``kv_on_push: keep``, PipelineRL), so a push between turns costs no hit; with
  ``kv_on_push: recompute`` (a new salt after a push), when the blocks were evicted, or with
  prefix caching off (engines that return routed experts), the whole context is prefilled
  again, under the new weights.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's KV block size on GPUs (vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE); the
# engine picks a larger one for chunked local attention (rollout.engine.vllm_engine).
VLLM_BLOCK_SIZE = 16


def kv_block_size(chunks: tuple[int | None, ...]) -> int:
    """The KV block size of the engines: vLLM's default, or for chunked local attention the
    largest of 128, 64, 32, 16 that divides the chunk (``vllm_engine.engine_args``)."""
    chunk = next((c for c in chunks if c), None)
    if not chunk:
        return VLLM_BLOCK_SIZE
    return next((b for b in (128, 64, 32, 16) if chunk % b == 0), VLLM_BLOCK_SIZE)


@dataclass(frozen=True)
class EpisodePlan:
    """Token counts of one episode at its limits (upper bounds unless said otherwise).

    Attributes:
        max_turns: ``rollout.max_turns``.
        environment, tool_format: ``rollout.environment.name`` / ``tool_format``.
        calls: tool calls at most (``max_turns - 1``).
        prompt: the longest prompt (``data.max_prompt_tokens``).
        budget: ``rollout.max_tokens``: model and tool tokens of the episode together.
        longest_sequence: prompt + the longest response: what the trainer's micro-batches
            and an engine request's KV are sized for (the same as single-turn).
        tool_tokens: tool-output tokens at most: ``calls x max_tool_output_tokens``, within
            the budget (wrappers of the format and the truncation marker not counted).
        model_tokens: decoded tokens at least when every call returns its most.
        block: the engines' KV block size.
        prefill_cached: prefilled tokens of an episode whose later turns hit the prefix
            cache: the prompt, the tool tokens, and per later turn at most one block of the
            context (the partial block the cache does not hold, and the turn's stop token).
        prefill_uncached: prefilled tokens when no later turn hits the cache (eviction, a
            push with kv_on_push recompute, prefix caching off): the prompt, then per
            later turn its whole context, at most the longest sequence.
        prefix_caching: the engines cache prefixes at all.
        tool_workers: tool calls running at once per engine; ``tool_timeout_s``: the limit
            of one; ``tool_memory_mb``: the address-space limit of each (host memory).
    """

    max_turns: int
    environment: str
    tool_format: str
    calls: int
    prompt: int
    budget: int
    longest_sequence: int
    tool_tokens: int
    model_tokens: int
    block: int
    prefill_cached: int
    prefill_uncached: int
    prefix_caching: bool
    tool_workers: int
    tool_timeout_s: float
    tool_memory_mb: int = 0

    @property
    def tool_memory_bytes(self) -> int:
        """Host memory of one engine's tool sandboxes at their limits."""
        return self.tool_workers * self.tool_memory_mb * 2**20

    @property
    def tool_share(self) -> float:
        """The largest share of the episode's budget that is tool output (prefill only)."""
        return self.tool_tokens / self.budget

    @property
    def prefill_growth(self) -> float:
        """Prefilled tokens of an episode without prefix-cache hits over those with them."""
        return self.prefill_uncached / self.prefill_cached


def episode_plan(config, block: int = VLLM_BLOCK_SIZE) -> EpisodePlan | None:
    """The episode's token counts of ``config`` (a RunConfig); None for single-turn runs.
    ``block``: the engines' KV block size (``kv_block_size``)."""
    rollout = config.rollout
    if not rollout.episodes:
        return None
    env = rollout.environment
    calls = rollout.max_turns - 1
    prompt = config.data.max_prompt_tokens
    budget = rollout.max_tokens
    longest = prompt + config.max_response_tokens()
    # every turn decodes at least its stop token: the tools can have the rest
    tool_tokens = min(calls * env.max_tool_output_tokens, budget - rollout.max_turns)
    caching = rollout.prefix_caching and not rollout.return_routed_experts
    cached = prompt + tool_tokens + calls * block
    uncached = prompt + calls * longest
    return EpisodePlan(
        max_turns=rollout.max_turns,
        environment=env.name,
        tool_format=env.tool_format,
        calls=calls,
        prompt=prompt,
        budget=budget,
        longest_sequence=longest,
        tool_tokens=tool_tokens,
        model_tokens=budget - tool_tokens,
        block=block,
        prefill_cached=cached if caching else uncached,
        prefill_uncached=uncached,
        prefix_caching=caching,
        tool_workers=env.tool_workers,
        tool_timeout_s=env.tool_timeout_s,
        tool_memory_mb=env.tool_memory_mb,
    )

"""Multi-turn environments: the model calls a sandboxed tool mid-answer (issue 38).

The pieces, each usable alone:

- ``formats``: a model family's tool-call convention (Llama-3.1 ``<|python_tag|>`` ...
  ``<|eom_id|>``, Qwen ``<tool_call>`` JSON, base-model ````python`` + ````output``): what
  the engine stops on, how a call is read from a turn, how the output is rendered.
- ``protocol``: ``Environment`` (``reset(problem)``, ``step(call) -> (result, done)``,
  ``reward(episode)``), ``Episode`` / ``Turn`` (the token ids of every segment),
  ``ToolResult`` (outcome ok / error / timeout / truncated).
- ``registry``: environments by name (built-ins, and the ``megatron_rl.environments``
  entry points of installed packages); ``config``: ``rollout.environment``.
- ``python_tool`` (math) and ``code_feedback`` (code: public tests shown, hidden scored).
- ``tools``: running a call in the code sandbox, cutting its output to a token budget, and
  ``ToolExecutor``, the threads tool calls run on.

How the episode loop (next: in the generator pool, on the PipelineRL path) uses them,
token-in / token-out, so that nothing is ever detokenized and tokenized again:

1. ``env = make_environment(name, context)`` per episode; ``env.reset(problem)`` gives the
   problem text, rendered into the prompt as for single-turn samples; the prompt is
   tokenized once (``prompt_ids``).
2. The engine generates from ids with the format's ``stop_strings`` (kept in the output:
   vLLM ``include_stop_str_in_output``) and ``stop_token_ids(tokenizer)`` added to the
   request. The turn's ids, log-probs and per-token policy versions are appended as they
   come (a weight push mid-turn keeps each token's own version).
3. ``fmt.parse_ids(turn_ids, tokenizer)``: None ends the episode (a final answer). A call
   goes to ``ToolExecutor.submit(env, call)``; the engine meanwhile serves other episodes'
   requests. When the future resolves: ``done`` ends the episode, else
   ``fmt.observation_ids(result.output, tokenizer)`` (tokenized once) is appended by id
   with mask False, log-prob 0 and no policy version (the lag bound and the log-prob gap
   monitor read model tokens only), and the engine continues from
   ``prompt_ids + all ids so far`` as a new request (a prefix-cache hit) up to
   ``rollout.max_turns`` turns and the episode's token budget (``rollout.max_tokens``
   over all turns; the forced interruption at that budget).
4. ``env.reward_request(episode)`` for every finished episode of a group, scored in one
   ``RewardPool.score_batch``; ``Episode.loss_mask()`` is the sample's mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "EnvironmentConfig": "megatron_rl.environments.config",
    "Environment": "megatron_rl.environments.protocol",
    "EnvironmentContext": "megatron_rl.environments.protocol",
    "Episode": "megatron_rl.environments.protocol",
    "Turn": "megatron_rl.environments.protocol",
    "ToolResult": "megatron_rl.environments.protocol",
    "ToolCall": "megatron_rl.environments.formats",
    "ToolFormat": "megatron_rl.environments.formats",
    "format_for": "megatron_rl.environments.formats",
    "make_environment": "megatron_rl.environments.registry",
    "available": "megatron_rl.environments.registry",
    "ToolExecutor": "megatron_rl.environments.tools",
}

__all__ = [
    "Environment",
    "EnvironmentConfig",
    "EnvironmentContext",
    "Episode",
    "ToolCall",
    "ToolExecutor",
    "ToolFormat",
    "ToolResult",
    "Turn",
    "available",
    "format_for",
    "make_environment",
]

if TYPE_CHECKING:
    from megatron_rl.environments.config import EnvironmentConfig
    from megatron_rl.environments.formats import ToolCall, ToolFormat, format_for
    from megatron_rl.environments.protocol import (
        Environment,
        EnvironmentContext,
        Episode,
        ToolResult,
        Turn,
    )
    from megatron_rl.environments.registry import available, make_environment
    from megatron_rl.environments.tools import ToolExecutor


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

"""How long prompts and responses are in the simulator (the length model), stated in one place.

The paper gives the budgets (prompt <= 2,048 tokens; thinking cut at a budget drawn uniformly
in [10,240, 12,288], then the interruption text and at most 2,048 answer tokens; truncation
should stay under ~5%) but not the distribution of lengths. Ours, an assumption to vary:

- prompt tokens ~ LogNormal(median ``prompt_median``, sigma ``prompt_sigma``), clipped to
  [16, max_prompt_tokens] (Polaris math problems are short);
- the thinking the model *would* write ~ LogNormal(``think_median``, ``think_sigma``); with the
  defaults (4,000, 0.6) about 4% of samples reach a budget of ~11k and are interrupted;
- answer tokens ~ LogNormal(``answer_median``, ``answer_sigma``), clipped to the answer budget;
- interrupted sample: budget + ``interruption_tokens`` + answer; otherwise thinking + answer;
  always at most ``rollout.max_tokens``.

Without interruptions the response is thinking + answer, cut at ``max_tokens``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthModel:
    """Prompt and response lengths (tokens) of simulated samples (see module docstring)."""

    max_prompt_tokens: int = 2048
    max_tokens: int = 14336
    thinking_budget: tuple[int, int] | None = (10240, 12288)
    answer_budget: int = 2048
    interruption_tokens: int = 20
    prompt_median: float = 200.0
    prompt_sigma: float = 0.5
    think_median: float = 4000.0
    think_sigma: float = 0.6
    answer_median: float = 400.0
    answer_sigma: float = 0.5

    def prompt_length(self, rng: random.Random) -> int:
        n = int(rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma))
        return max(16, min(n, self.max_prompt_tokens))

    def response_length(self, rng: random.Random) -> tuple[int, bool]:
        """(response tokens, interrupted) of one sample."""
        think = int(rng.lognormvariate(math.log(self.think_median), self.think_sigma))
        answer = int(rng.lognormvariate(math.log(self.answer_median), self.answer_sigma))
        answer = max(1, min(answer, self.answer_budget))
        if self.thinking_budget is not None:
            budget = rng.randint(*self.thinking_budget)
            if think >= budget:
                return min(budget + self.interruption_tokens + answer, self.max_tokens), True
        return max(1, min(think + answer, self.max_tokens)), False


def length_model(config, **overrides) -> LengthModel:
    """The length model of a recipe (``RunConfig``): its budgets, our distributions."""
    rollout = config.rollout
    interruption = rollout.interruption
    return LengthModel(
        max_prompt_tokens=config.data.max_prompt_tokens,
        max_tokens=rollout.max_tokens,
        thinking_budget=tuple(interruption.thinking_budget) if interruption.enabled else None,
        answer_budget=interruption.answer_budget,
        **overrides,
    )

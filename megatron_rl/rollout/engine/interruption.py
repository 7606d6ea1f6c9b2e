"""ScaleRL's forced length interruption, on token ids (no vLLM here).

A sample whose response reaches its thinking budget (drawn uniformly per sample) without
containing the think-close marker is cut at the budget; the interruption text is appended
(masked: no loss) and generation continues for at most the answer budget. Samples that close
their thinking before the budget are left alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megatron_rl.rollout.config import InterruptionConfig

Encode = Callable[[str], list[int]]


def find_subsequence(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of ``needle`` in ``haystack[start:]`` (absolute), or -1."""
    n = len(needle)
    if n == 0:
        return start if start <= len(haystack) else -1
    first = needle[0]
    for i in range(max(start, 0), len(haystack) - n + 1):
        if haystack[i] == first and list(haystack[i : i + n]) == list(needle):
            return i
    return -1


def count_subsequence(haystack: Sequence[int], needle: Sequence[int]) -> int:
    """Number of (possibly overlapping) occurrences of ``needle`` in ``haystack``."""
    count, i = 0, find_subsequence(haystack, needle)
    while i >= 0:
        count += 1
        i = find_subsequence(haystack, needle, i + 1)
    return count


@dataclass(frozen=True)
class InterruptionPolicy:
    """The interruption settings in token ids, with the per-sample budget RNG.

    ``text_ids``: the appended tokens; ``close_ids``: the think-close marker's tokens.
    """

    budget_range: tuple[int, int]
    answer_budget: int
    text_ids: tuple[int, ...]
    close_ids: tuple[int, ...]
    rng: random.Random

    @classmethod
    def from_config(cls, config: InterruptionConfig, encode: Encode) -> InterruptionPolicy:
        """Tokenize the configured texts with ``encode`` (text -> ids, no special tokens)."""
        config.validate()
        text_ids = tuple(encode(config.text))
        close_ids = tuple(encode(config.think_close))
        if not text_ids or not close_ids:
            raise ValueError("interruption.text / think_close encode to no tokens")
        lo, hi = config.thinking_budget
        return cls((lo, hi), config.answer_budget, text_ids, close_ids, random.Random(config.seed))

    def draw_budget(self) -> int:
        """A thinking budget drawn uniformly from the configured integer range."""
        return self.rng.randint(*self.budget_range)

    def closed(self, response_ids: Sequence[int], start: int = 0) -> bool:
        """Whether the think-close marker occurs in ``response_ids`` (searching from ``start``)."""
        return find_subsequence(response_ids, self.close_ids, max(start, 0)) >= 0

    def should_interrupt(self, response_ids: Sequence[int], budget: int, closed: bool) -> bool:
        """Cut now: the budget is reached and the first ``budget`` tokens do not close."""
        if closed or len(response_ids) < budget:
            return False
        return not self.closed(response_ids[:budget])

    def max_response_tokens(self, budget: int) -> int:
        """Upper bound of an interrupted sample's response length."""
        return budget + len(self.text_ids) + self.answer_budget

"""Training-prompt sampler: epochs, seeded shuffles, No-Positive-Resampling, exact resume.

Epoch ``e`` visits the training ids in the order of a shuffle seeded by
``(seed, e)``; the sampler's whole state is ``(epoch, position)`` in that order, so a
sampler restored from ``state_dict()`` continues with exactly the prompts an
uninterrupted one would have drawn. Retired prompts (No-Positive-Resampling: historical
pass rate >= threshold) are skipped when they come up, which removes them from every later
epoch; the retirement tracker (``megatron_rl.algorithms.PassRateTracker`` or anything with
``is_retired``) keeps and checkpoints its own state.

A mixture of sources (math + code) draws through ``MixedPromptSampler``: one
``PromptSampler`` per source (its own epochs and shuffles) and a deterministic interleave by
weight that keeps the mix exact at every point of the stream (after ``n`` draws source ``i``
has given ``n * w_i`` prompts, within one), so every window of ``sum(weights)`` draws holds
exactly ``weight_i`` prompts of source ``i`` when the weights are integers.

DAPO-style dynamic sampling needs rewards, which the sampler never sees: the trainer's rollout
source (``megatron_rl.trainer.rollout_source``) scores each group as it completes, drops those
without reward variance (``has_reward_variance``) and draws a new prompt for each.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)


@runtime_checkable
class RetirementTracker(Protocol):
    """What the sampler needs from a No-Positive-Resampling tracker."""

    def is_retired(self, prompt_id: int) -> bool:
        """True when the prompt must never be drawn again."""
        ...


class PromptSampler:
    """Endless stream of training prompt ids.

    Args:
        prompt_ids: the training ids (stable dataset indices), e.g. ``PromptData.train_ids``.
        seed: seed of the per-epoch shuffles.
        shuffle: False visits the ids in the given order every epoch.
        tracker: optional retirement tracker (can also be set later with ``tracker=``).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        seed: int = 0,
        shuffle: bool = True,
        tracker: RetirementTracker | None = None,
    ) -> None:
        if not prompt_ids:
            raise ValueError("PromptSampler needs at least one prompt id")
        if len(set(prompt_ids)) != len(prompt_ids):
            raise ValueError("prompt_ids contain duplicates")
        self._ids = [int(i) for i in prompt_ids]
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.tracker = tracker
        self._epoch = 0
        self._position = 0
        self._drawn = 0
        self._order = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        """Current epoch (0-based)."""
        return self._epoch

    @property
    def num_drawn(self) -> int:
        """Prompts drawn since the start (over all epochs and resumes)."""
        return self._drawn

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(self._ids)
        if self.shuffle:
            random.Random(f"prompt-sampler-{self.seed}-{epoch}").shuffle(order)
        return order

    def _fingerprint(self) -> str:
        return hashlib.sha256(",".join(map(str, self._ids)).encode()).hexdigest()[:16]

    def _retired(self, prompt_id: int) -> bool:
        return self.tracker is not None and self.tracker.is_retired(prompt_id)

    def next_prompts(self, n: int) -> list[int]:
        """The next ``n`` non-retired prompt ids, crossing epoch boundaries as needed.

        Raises RuntimeError when every training prompt is retired.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        drawn: list[int] = []
        skipped_in_a_row = 0
        while len(drawn) < n:
            if self._position >= len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
                logger.info("prompt sampler: epoch %d", self._epoch)
            prompt_id = self._order[self._position]
            self._position += 1
            if self._retired(prompt_id):
                skipped_in_a_row += 1
                if skipped_in_a_row > len(self._ids):
                    raise RuntimeError("all training prompts are retired (No-Positive-Resampling)")
                continue
            skipped_in_a_row = 0
            drawn.append(prompt_id)
        self._drawn += len(drawn)
        return drawn

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_prompts(1)[0]

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: the position in the current epoch's order."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "drawn": self._drawn,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": len(self._ids),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; ValueError when it belongs to other prompts/seed."""
        missing = {"epoch", "position", "seed", "fingerprint"} - set(state)
        if missing:
            raise ValueError(f"sampler state is missing keys {sorted(missing)}")
        if state["fingerprint"] != self._fingerprint():
            raise ValueError(
                "sampler state was saved for other training prompts "
                f"({state.get('num_prompts')} ids, fingerprint {state['fingerprint']}) than "
                f"these ({len(self._ids)} ids, fingerprint {self._fingerprint()})"
            )
        if int(state["seed"]) != self.seed or bool(state.get("shuffle", True)) != self.shuffle:
            raise ValueError(
                f"sampler state has seed={state['seed']} shuffle={state.get('shuffle')}, "
                f"this sampler seed={self.seed} shuffle={self.shuffle}"
            )
        if not 0 <= int(state["position"]) <= len(self._ids) or int(state["epoch"]) < 0:
            raise ValueError(f"sampler state out of range: {state}")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._drawn = int(state.get("drawn", 0))
        self._order = self._epoch_order(self._epoch)


class MixedPromptSampler:
    """Endless stream of training prompt ids drawn from several sources by weight.

    Draw ``n + 1`` goes to the source with the largest deficit ``(n + 1) * w_i - drawn_i``
    (``w`` normalised; ties to the first source), from that source's own ``PromptSampler``.
    A source whose prompts are all retired (No-Positive-Resampling) leaves the mix and the
    others share its weight; when none is left, ``next_prompts`` raises RuntimeError.

    Args:
        sources: (name, training ids, weight) of each source; ids disjoint across sources.
        seed / shuffle / tracker: as ``PromptSampler`` (shared by every source).
    """

    def __init__(
        self,
        sources: Sequence[tuple[str, Sequence[int], float]],
        seed: int = 0,
        shuffle: bool = True,
        tracker: RetirementTracker | None = None,
    ) -> None:
        if not sources:
            raise ValueError("MixedPromptSampler needs at least one source")
        names = [str(name) for name, _, _ in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"source names repeat: {names}")
        weights = [float(w) for _, _, w in sources]
        if any(not w > 0 for w in weights):
            raise ValueError(f"source weights must be > 0, got {weights}")
        all_ids = [int(i) for _, ids, _ in sources for i in ids]
        if len(set(all_ids)) != len(all_ids):
            raise ValueError("the sources' prompt ids overlap")
        self.names = names
        self.weights = weights
        self._samplers = [PromptSampler(ids, seed=seed, shuffle=shuffle) for _, ids, _ in sources]
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.tracker = tracker
        self._counts = [0] * len(sources)
        self._exhausted: set[int] = set()

    @property
    def tracker(self) -> RetirementTracker | None:
        return self._tracker

    @tracker.setter
    def tracker(self, tracker: RetirementTracker | None) -> None:
        self._tracker = tracker
        for sampler in getattr(self, "_samplers", []):
            sampler.tracker = tracker

    @property
    def epoch(self) -> int:
        """Fewest epochs completed by any active source (0-based, like ``PromptSampler``)."""
        active = [s for k, s in enumerate(self._samplers) if k not in self._exhausted]
        return min((s.epoch for s in active), default=0)

    @property
    def num_drawn(self) -> int:
        """Prompts drawn since the start (over all sources, epochs and resumes)."""
        return sum(self._counts)

    def drawn_by_source(self) -> dict[str, int]:
        """Prompts drawn from each source since the start."""
        return dict(zip(self.names, self._counts))

    def _next_source(self) -> int:
        active = [k for k in range(len(self._samplers)) if k not in self._exhausted]
        if not active:
            raise RuntimeError("all training prompts are retired (No-Positive-Resampling)")
        total_weight = sum(self.weights[k] for k in active)
        n = sum(self._counts[k] for k in active) + 1
        return max(active, key=lambda k: (n * self.weights[k] / total_weight - self._counts[k], -k))

    def next_prompts(self, n: int) -> list[int]:
        """The next ``n`` non-retired prompt ids of the mixture."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        drawn: list[int] = []
        while len(drawn) < n:
            k = self._next_source()
            try:
                drawn += self._samplers[k].next_prompts(1)
            except RuntimeError:
                logger.info("prompt source %s: every prompt retired; it leaves the mix",
                            self.names[k])  # fmt: skip
                self._exhausted.add(k)
                continue
            self._counts[k] += 1
        return drawn

    def __iter__(self) -> Iterator[int]:
        while True:
            yield self.next_prompts(1)[0]

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state: per-source counts and sampler states."""
        return {
            "mixture": self.names,
            "weights": self.weights,
            "counts": list(self._counts),
            "exhausted": sorted(self._exhausted),
            "sources": [s.state_dict() for s in self._samplers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``; ValueError when it belongs to another mixture."""
        if state.get("mixture") != self.names or [float(w) for w in state["weights"]] != (
            self.weights
        ):
            raise ValueError(
                f"sampler state was saved for the mixture {state.get('mixture')} with weights "
                f"{state.get('weights')}, not {self.names} with {self.weights}"
            )
        for sampler, sub in zip(self._samplers, state["sources"]):
            sampler.load_state_dict(sub)
        self._counts = [int(c) for c in state["counts"]]
        self._exhausted = {int(k) for k in state["exhausted"]}


def has_reward_variance(rewards: Sequence[float]) -> bool:
    """True when a group's rewards are not all equal (it carries a learning signal)."""
    return len(rewards) > 1 and any(r != rewards[0] for r in rewards)

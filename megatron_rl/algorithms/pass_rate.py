"""No-Positive-Resampling: per-prompt pass-rate history; easy prompts retire for good."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from megatron_rl.algorithms.config import NPR_HISTORY_NAMES

logger = logging.getLogger(__name__)


def _as_list(values: torch.Tensor | Iterable[Any]) -> list[Any]:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().tolist()
    return list(values)


class PassRateTracker:
    """Pass-rate history of every prompt seen, running over all epochs.

    A prompt retires for good once its pass rate reaches ``threshold`` (ScaleRL: 0.9); the
    sampler skips retired prompts in later epochs. The compared pass rate is that of all
    the prompt's samples so far (``history="cumulative"``) or of its last observed group
    (``history="latest"``). A sample passes when its reward is > ``success_threshold``
    (+1 / -1 rewards: 0); boolean "rewards" are taken as correctness directly (use them when
    a length penalty shifts the rewards of correct samples).
    """

    def __init__(
        self,
        threshold: float = 0.9,
        history: str = "cumulative",
        success_threshold: float = 0.0,
    ) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if history not in NPR_HISTORY_NAMES:
            raise ValueError(f"history must be one of {list(NPR_HISTORY_NAMES)}, got {history!r}")
        self.threshold = float(threshold)
        self.history = history
        self.success_threshold = float(success_threshold)
        self._passes: dict[Hashable, int] = {}
        self._samples: dict[Hashable, int] = {}
        self._latest: dict[Hashable, float] = {}
        self._retired: set[Hashable] = set()

    def update(
        self, prompt_ids: torch.Tensor | Iterable[Hashable], rewards: torch.Tensor | Iterable
    ) -> list[Hashable]:
        """Record one reward per sample (``prompt_ids [S]``, ``rewards [S]``).

        Returns:
            The prompts retired by this update.
        """
        ids, values = _as_list(prompt_ids), _as_list(rewards)
        if len(ids) != len(values):
            raise ValueError(
                f"prompt_ids and rewards must have the same length, got {len(ids)} and "
                f"{len(values)}"
            )
        passes: dict[Hashable, int] = {}
        counts: dict[Hashable, int] = {}
        for pid, value in zip(ids, values):
            ok = value if isinstance(value, bool) else value > self.success_threshold
            passes[pid] = passes.get(pid, 0) + int(ok)
            counts[pid] = counts.get(pid, 0) + 1
        newly: list[Hashable] = []
        for pid, count in counts.items():
            self._passes[pid] = self._passes.get(pid, 0) + passes[pid]
            self._samples[pid] = self._samples.get(pid, 0) + count
            self._latest[pid] = passes[pid] / count
            if pid not in self._retired and self._compared_rate(pid) >= self.threshold:
                self._retired.add(pid)
                newly.append(pid)
        if newly:
            logger.debug("retired %d prompts (%d in all)", len(newly), len(self._retired))
        return newly

    def _compared_rate(self, prompt_id: Hashable) -> float:
        if self.history == "latest":
            return self._latest[prompt_id]
        return self._passes[prompt_id] / self._samples[prompt_id]

    def pass_rate(self, prompt_id: Hashable) -> float | None:
        """Pass rate of all the prompt's samples so far, None if never seen."""
        if prompt_id not in self._samples:
            return None
        return self._passes[prompt_id] / self._samples[prompt_id]

    def is_retired(self, prompt_id: Hashable) -> bool:
        """True once the prompt's pass rate has reached the threshold (for good)."""
        return prompt_id in self._retired

    @property
    def num_retired(self) -> int:
        """Number of retired prompts."""
        return len(self._retired)

    def state_dict(self) -> dict[str, Any]:
        """Plain-Python state (lists of [id, value] pairs), for checkpoints."""
        return {
            "threshold": self.threshold,
            "history": self.history,
            "success_threshold": self.success_threshold,
            "passes": [[k, v] for k, v in self._passes.items()],
            "samples": [[k, v] for k, v in self._samples.items()],
            "latest": [[k, v] for k, v in self._latest.items()],
            "retired": list(self._retired),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict``; the thresholds of the checkpoint replace the current ones."""
        missing = {"passes", "samples", "latest", "retired"} - set(state)
        if missing:
            raise ValueError(f"PassRateTracker state is missing keys {sorted(missing)}")
        self.threshold = float(state.get("threshold", self.threshold))
        self.history = state.get("history", self.history)
        self.success_threshold = float(state.get("success_threshold", self.success_threshold))
        self._passes = {_key(k): int(v) for k, v in state["passes"]}
        self._samples = {_key(k): int(v) for k, v in state["samples"]}
        self._latest = {_key(k): float(v) for k, v in state["latest"]}
        self._retired = {_key(k) for k in state["retired"]}


def _key(key: Any) -> Hashable:
    # JSON / YAML round trips turn tuples into lists.
    return tuple(key) if isinstance(key, list) else key

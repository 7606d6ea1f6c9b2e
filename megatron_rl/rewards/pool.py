"""``RewardPool``: batch scoring of responses, safe to call from any thread of the trainer.

Math: extraction and static checks in the caller's process, symbolic verification in a
``WorkerPool`` of spawned processes with a hard per-answer time limit (a stuck worker is
killed and replaced). Code: each program in one sandbox that runs its tests in turn
(``sandbox.ProgramSession``), ``num_workers`` programs at a time; a pool that scores code checks first that the OS sandbox can be set up
(``megatron_rl.rewards.isolation``) and refuses to start otherwise.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_rl.rewards import code, math
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import box_for
from megatron_rl.rewards.workers import WorkerPool

logger = logging.getLogger(__name__)

# Statuses that are no verdict on the response: the verification (math) or the program's run
# (code: the wall-clock backstop; running out of CPU time is a verdict) ran out of time.
# They score ``incorrect_reward`` and are counted apart from wrong answers in the metrics.
TIMEOUT_STATUSES: tuple[str, ...] = (math.TIMEOUT, code.TIMEOUT_WALL)


class MissingReferenceError(ValueError):
    """An item to score has no reference (None, NaN, or empty text): scoring it against the
    text "None" would pay a response that answers ``\\boxed{None}``."""


def missing_reference(reference: Any) -> bool:
    """Whether ``reference`` is missing: None, a float NaN (a table's empty cell), or text
    (or a container) with nothing in it."""
    if reference is None:
        return True
    if isinstance(reference, float):
        return reference != reference  # NaN
    if isinstance(reference, str):
        return not reference.strip()
    if isinstance(reference, (list, tuple, dict)):
        return len(reference) == 0
    return False


def check_references(references: Sequence[Any], names: Sequence[Any] | None = None) -> None:
    """Raise ``MissingReferenceError`` naming the first item without a reference (by
    ``names[i]`` when given, e.g. a file's row number, else its index in the batch)."""
    for i, reference in enumerate(references):
        if missing_reference(reference):
            name = names[i] if names is not None else f"item {i} of the batch"
            raise MissingReferenceError(
                f"{name}: the reference is missing ({reference!r}); a row without a "
                "reference cannot be scored (drop it, or give its reference)"
            )


def count_timeouts(statuses: Sequence[str]) -> dict[str, int]:
    """``{"timeouts": all TIMEOUT_STATUSES, "timeouts_wall": code runs stopped by the
    wall-clock backstop}`` among ``statuses`` (``RewardPool.last_statuses``)."""
    return {
        "timeouts": sum(s in TIMEOUT_STATUSES for s in statuses),
        "timeouts_wall": sum(s == code.TIMEOUT_WALL for s in statuses),
    }


class RewardPool:
    """Scores batches of responses against their references.

    Args:
        config: verifier settings; ``config.kind`` is the default kind of every item.

    Use as a context manager or call ``close()``: it owns worker processes. With
    ``config.kind == "code"`` it raises ``SandboxUnavailableError`` at once where no code
    sandbox can be set up (see ``config.code_allow_unsafe_sandbox``); a math pool checks
    when it first meets a code item.
    """

    def __init__(self, config: RewardConfig) -> None:
        config.validate()
        self.config = config
        self._lock = threading.Lock()
        self._math: WorkerPool | None = None
        self._code: ThreadPoolExecutor | None = None
        # Counts over the pool's life, and the statuses of the last batch (``last_counts``
        # counts them): how each score was decided.
        self.stats: Counter[str] = Counter()
        self.last_statuses: list[str] = []
        # Seconds each item of the last batch took to verify (math: in its worker; code: its
        # tests' runs, starting the boxes not counted); 0 for items decided in process.
        self.last_seconds: list[float] = []
        if config.kind == "code":
            self._code_executor()

    def _math_pool(self) -> WorkerPool:
        # Started on first need: batches decided in-process (plain integers) never pay it.
        if self._math is None:
            self._math = WorkerPool(
                self.config.num_workers,
                self.config.timeout_s,
                memory_mb=self.config.worker_memory_mb,
                init=math.load_verifier,
                wall_timeout_s=self.config.wall_timeout_s,
            )
        return self._math

    def score_batch(
        self,
        responses: Sequence[str],
        references: Sequence[Any],
        kinds: Sequence[str] | None = None,
    ) -> list[float]:
        """Rewards ``[S]`` of ``responses [S]`` against ``references [S]``.

        References are answers (math) or tests (code, any format of ``code.parse_problem``).
        ``kinds [S]`` ("math" | "code") overrides ``config.kind`` per item (math+code runs).
        Raises ``MissingReferenceError`` naming the first item without a reference.
        """
        if len(responses) != len(references):
            raise ValueError(
                f"responses and references differ in length: {len(responses)} vs {len(references)}"
            )
        kinds = [self.config.kind] * len(responses) if kinds is None else list(kinds)
        if len(kinds) != len(responses):
            raise ValueError(f"kinds has {len(kinds)} entries for {len(responses)} responses")
        unknown = set(kinds) - {"math", "code"}
        if unknown:
            raise ValueError(f"unknown reward kinds {sorted(unknown)}")
        check_references(references)
        rewards: list[float] = [self.config.incorrect_reward] * len(responses)
        statuses = ["code"] * len(responses)
        seconds = [0.0] * len(responses)
        with self._lock:
            math_items = [i for i, k in enumerate(kinds) if k == "math"]
            code_items = [i for i, k in enumerate(kinds) if k == "code"]
            if math_items:
                self._score_math(math_items, responses, references, rewards, statuses, seconds)
            if code_items:
                self._score_code(code_items, responses, references, rewards, statuses, seconds)
            self.last_statuses = statuses
            self.last_seconds = seconds
        return rewards

    @property
    def last_counts(self) -> Counter[str]:
        """How many scores of the last batch had each status (see ``_score_math``)."""
        return Counter(self.last_statuses)

    def _score_math(
        self,
        items: list[int],
        responses: Sequence[str],
        references: Sequence[Any],
        rewards: list[float],
        statuses: list[str],
        seconds: list[float],
    ) -> None:
        """Math scores and their statuses: "in_process" (no answer, unsafe, or plain
        integers), or a verifier verdict: "correct", "wrong", "bad_reference", "timeout"
        (out of CPU time, or killed at the wall-clock limit), "error" or "crashed". Every
        status but "correct" scores ``incorrect_reward``; "timeout" is counted apart so that
        it is never mistaken for a wrong answer."""
        config = self.config
        to_verify: list[int] = []
        pairs: list[tuple[str, str, float]] = []
        for i in items:
            decided = math.prepare(str(responses[i]), str(references[i]), config)
            if isinstance(decided, tuple):
                to_verify.append(i)
                pairs.append((decided[0], decided[1], config.timeout_s))
            else:
                rewards[i], statuses[i] = decided, "in_process"
                self.stats["decided_in_process"] += 1
        if not pairs:
            return
        for i, result in zip(to_verify, self._math_pool().map(math.verify, pairs)):
            status = result.value if result.status == "ok" else result.status
            statuses[i] = status
            seconds[i] = result.elapsed_s
            self.stats[f"verify_{status}"] += 1
            if result.blocked:
                self.stats["blocked_events"] += len(result.blocked)
            if status == "timeout":
                logger.debug("math verification timed out: %s", result.error or "CPU limit")
            correct = status == math.CORRECT
            rewards[i] = config.correct_reward if correct else config.incorrect_reward

    def _score_code(
        self,
        items: list[int],
        responses: Sequence[str],
        references: Sequence[Any],
        rewards: list[float],
        statuses: list[str],
        seconds: list[float],
    ) -> None:
        """Code scores and their statuses (``code.CodeOutcome.status``): "correct",
        "wrong", "timeout_cpu" (a verdict: too slow), "timeout_wall" (none: counted apart),
        "error", "no_program" or "bad_tests"."""
        executor = self._code_executor()
        futures = [
            executor.submit(code.code_outcome, str(responses[i]), references[i], self.config)
            for i in items
        ]
        for i, future in zip(items, futures):
            outcome = future.result()
            correct = outcome.status == code.CORRECT
            rewards[i] = self.config.correct_reward if correct else self.config.incorrect_reward
            statuses[i], seconds[i] = outcome.status, outcome.wall_s
            self.stats["code_scored"] += 1
            self.stats[f"code_{outcome.status}"] += 1

    def _code_executor(self) -> ThreadPoolExecutor:
        # Started on first need, after checking the sandbox (which warns when it is unsafe).
        if self._code is None:
            box_for(self.config, announce=True)
            self._code = ThreadPoolExecutor(self.config.num_workers, "reward-code")
        return self._code

    def close(self) -> None:
        """Stop the worker processes and threads."""
        if self._math is not None:
            self._math.close()
            self._math = None
        if self._code is not None:
            self._code.shutdown(wait=True)
            self._code = None

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

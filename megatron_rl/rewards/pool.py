"""``RewardPool``: batch scoring of responses, safe to call from any thread of the trainer.

Math: extraction and static checks in the caller's process, symbolic verification in a
``WorkerPool`` of spawned processes with a hard per-answer time limit (a stuck worker is
killed and replaced). Code: each program in one sandbox that runs its tests in turn
(``sandbox.ProgramSession``), ``num_workers`` programs at a time; a pool that scores code checks first that the OS sandbox can be set up
(``megatron_rl.rewards.isolation``) and refuses to start otherwise.

Nothing a policy writes stops a run: an exception while scoring one response (in this
process, in a worker, in the code path) scores that response ``incorrect_reward`` with the
status "error" (a worker that died twice: "crashed"), logged once per kind of failure with
the response; the trainer counts them per step (``count_errors``) and stops only when more
than ``reward.max_error_fraction`` of a batch fail (``check_error_fraction``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from megatron_rl.rewards import code, math, registry
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import answer_section
from megatron_rl.rewards.isolation import box_for
from megatron_rl.rewards.workers import WorkerPool, WorkersUnavailable, describe_exception

logger = logging.getLogger(__name__)

# Statuses that are no verdict on the response: the verification (math) or the program's run
# (code: the wall-clock backstop; running out of CPU time is a verdict) ran out of time.
# They score ``incorrect_reward`` and are counted apart from wrong answers in the metrics.
TIMEOUT_STATUSES: tuple[str, ...] = (math.TIMEOUT, code.TIMEOUT_WALL)
# Statuses of a response whose scoring failed (no verdict either): "error" (the verifier
# raised, in this process or a worker; the code sandbox failed; a worker's result could not
# be read) and "crashed" (its math worker died twice). They score ``incorrect_reward``.
ERROR, CRASHED = "error", "crashed"
ERROR_STATUSES: tuple[str, ...] = (ERROR, CRASHED)
# Characters of a response and of a reference shown in the log of a failure (head and tail).
_LOGGED_CHARS = 300


class RewardFailure(RuntimeError):
    """The reward cannot go on: its worker processes cannot be started, or scoring failed
    on more than ``reward.max_error_fraction`` of a batch (``check_error_fraction``). The
    trainer stops (after saving the checkpoint that is due)."""


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


def count_errors(statuses: Sequence[str]) -> int:
    """Responses among ``statuses`` (``RewardPool.last_statuses``) whose scoring failed."""
    return sum(s in ERROR_STATUSES for s in statuses)


def check_error_fraction(statuses: Sequence[str], max_fraction: float, what: str) -> None:
    """Raise ``RewardFailure`` when scoring failed on more than ``max_fraction``
    (``reward.max_error_fraction``) of ``statuses``, the batch ``what`` (e.g. "the batch of
    step 7") scored: a reward that fails on most responses is broken, not a policy's doing."""
    errors = count_errors(statuses)
    if statuses and errors > max_fraction * len(statuses):
        kinds = Counter(s for s in statuses if s in ERROR_STATUSES)
        raise RewardFailure(
            f"scoring failed on {errors} of the {len(statuses)} responses of {what} "
            f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), over "
            f"reward.max_error_fraction {max_fraction}: the reward is broken (the first "
            "failure of each kind is logged above with its response); fix it, or raise "
            "reward.max_error_fraction"
        )


def _clip(value: Any) -> str:
    """``repr`` of a response or reference for a log line: its head and tail when long."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # noqa: BLE001 - a log line must not fail
        return f"<unprintable {type(value).__name__}>"
    if len(text) > 2 * _LOGGED_CHARS:
        cut = len(text) - 2 * _LOGGED_CHARS
        text = f"{text[:_LOGGED_CHARS]} ... [{cut} characters] ... {text[-_LOGGED_CHARS:]}"
    return repr(text)


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
        # Math workers that died while verifying each item of the last batch (the item ran
        # again after the first death; after a second it is "crashed").
        self.last_crashes: list[int] = []
        self._logged_failures: set[tuple[str, str]] = set()  # (domain, kind) logged once
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
        Raises ``MissingReferenceError`` naming the first item without a reference, and
        ``RewardFailure`` when the math workers cannot be started. Any other failure to
        score an item is that item's alone: it scores ``incorrect_reward`` with the status
        "error" or "crashed" (``last_statuses``), logged once per kind.
        """
        if len(responses) != len(references):
            raise ValueError(
                f"responses and references differ in length: {len(responses)} vs {len(references)}"
            )
        kinds = [self.config.kind] * len(responses) if kinds is None else list(kinds)
        if len(kinds) != len(responses):
            raise ValueError(f"kinds has {len(kinds)} entries for {len(responses)} responses")
        plugins = {k: v for k, v in registry.registered().items() if k in set(kinds)}
        unknown = set(kinds) - {"math", "code"} - set(plugins)
        if unknown:
            raise ValueError(f"unknown reward kinds {sorted(unknown)}")
        check_references(references)
        rewards: list[float] = [self.config.incorrect_reward] * len(responses)
        statuses = ["code"] * len(responses)
        seconds = [0.0] * len(responses)
        crashes = [0] * len(responses)
        with self._lock:
            math_items = [i for i, k in enumerate(kinds) if k == "math"]
            code_items = [i for i, k in enumerate(kinds) if k == "code"]
            if math_items:
                scored = (rewards, statuses, seconds, crashes)
                self._score_math(math_items, responses, references, *scored)
            if code_items:
                self._score_code(code_items, responses, references, rewards, statuses, seconds)
            for name, value in plugins.items():
                items = [i for i, k in enumerate(kinds) if k == name]
                scored = (rewards, statuses, seconds, crashes)
                self._score_plugin(name, value, items, responses, references, *scored)
            self.last_statuses = statuses
            self.last_seconds = seconds
            self.last_crashes = crashes
        return rewards

    def _failed(
        self,
        domain: str,
        kind: str,
        detail: str,
        response: Any,
        reference: Any,
        status: str = ERROR,
    ) -> None:
        """Count a response whose scoring failed (its ``status``); log the first failure of
        each ``kind`` (an exception's type) in ``domain`` with the response, later ones at
        debug level."""
        self.stats[f"{domain}_failed_{kind}"] += 1
        first = (domain, kind) not in self._logged_failures
        self._logged_failures.add((domain, kind))
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "scoring a %s response failed (%s); it scores reward.incorrect_reward with the "
            "status '%s'%s.\n  response: %s\n  reference: %s",
            domain,
            detail,
            status,
            " (only the first failure of this kind is logged)" if first else "",
            _clip(response),
            _clip(reference),
        )

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
        crashes: list[int],
    ) -> None:
        """Math scores and their statuses: "in_process" (no answer, unsafe, or plain
        integers), or a verifier verdict: "correct", "wrong", "bad_reference", "timeout"
        (out of CPU time, or killed at the wall-clock limit), "error" (the checks here or
        the verifier raised) or "crashed" (the worker died twice). Every status but
        "correct" scores ``incorrect_reward``; "timeout", "error" and "crashed" are counted
        apart so that they are never mistaken for wrong answers."""
        config = self.config
        to_verify: list[int] = []
        pairs: list[tuple[str, str, float]] = []
        for i in items:
            try:
                decided = math.prepare(str(responses[i]), str(references[i]), config)
            except Exception as exc:  # noqa: BLE001 - one response's failure is its own
                statuses[i] = ERROR
                detail = f"in this process: {describe_exception(exc)}"
                self._failed("math", type(exc).__name__, detail, responses[i], references[i])
                continue
            if isinstance(decided, tuple):
                to_verify.append(i)
                pairs.append((decided[0], decided[1], config.timeout_s))
            else:
                rewards[i], statuses[i] = decided, "in_process"
                self.stats["decided_in_process"] += 1
        if not pairs:
            return
        try:
            results = self._math_pool().map(math.verify, pairs)
        except WorkersUnavailable as err:
            self._math = None  # closed by the failure
            raise RewardFailure(
                f"{err}; math answers cannot be verified (does the verifier import in this "
                f"environment? does it fit reward.worker_memory_mb, {config.worker_memory_mb} "
                "MB over a worker's size after its imports?)"
            ) from err
        for i, result in zip(to_verify, results):
            status = result.value if result.status == "ok" else result.status
            statuses[i] = status
            seconds[i] = result.elapsed_s
            crashes[i] = result.crashes
            self.stats[f"verify_{status}"] += 1
            if status == ERROR:
                kind = result.error.split(":", 1)[0] or "error"
                detail = f"in a worker: {result.error}"
                self._failed("math", kind, detail, responses[i], references[i])
            elif status == CRASHED:
                self._failed("math", CRASHED, result.error, responses[i], references[i], CRASHED)
            if result.blocked:
                self.stats["blocked_events"] += len(result.blocked)
            if status == "timeout":
                logger.debug("math verification timed out: %s", result.error or "CPU limit")
            correct = status == math.CORRECT
            rewards[i] = config.correct_reward if correct else config.incorrect_reward

    def _score_plugin(
        self,
        name: str,
        value: str,
        items: list[int],
        responses: Sequence[str],
        references: Sequence[Any],
        rewards: list[float],
        statuses: list[str],
        seconds: list[float],
        crashes: list[int],
    ) -> None:
        """Scores of a reward plug-in (``registry``), in the math workers under their limits:
        "correct" (the correct reward), "wrong" (any other), "in_process" (no answer after
        the thinking: not called), "timeout", "error" (it raised or returned no reward) or
        "crashed", as math's."""
        config = self.config
        to_score: list[int] = []
        tasks = []
        for i in items:
            answer = answer_section(
                str(responses[i]), config.think_end_tag, config.require_think_end
            )
            if answer is None:
                statuses[i] = "in_process"
                continue
            to_score.append(i)
            reward_range = (config.correct_reward, config.incorrect_reward)
            tasks.append((value, answer, references[i], *reward_range))
        if not tasks:
            return
        try:
            results = self._math_pool().map(registry.score, tasks)
        except WorkersUnavailable as err:
            self._math = None
            raise RewardFailure(f"{err}; the reward plug-in {name} cannot run") from err
        for i, result in zip(to_score, results):
            seconds[i], crashes[i] = result.elapsed_s, result.crashes
            if result.status == "ok":
                rewards[i] = float(result.value)
                statuses[i] = "correct" if rewards[i] == config.correct_reward else "wrong"
                continue
            statuses[i] = result.status
            if result.status in (ERROR, CRASHED):
                kind = CRASHED if result.status == CRASHED else result.error.split(":", 1)[0]
                detail = f"in a worker: {result.error}"
                self._failed(
                    name, kind or "error", detail, responses[i], references[i], result.status
                )

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
            executor.submit(_code_outcome, responses[i], references[i], self.config) for i in items
        ]
        for i, future in zip(items, futures):
            try:
                outcome = future.result()
            except Exception as exc:  # noqa: BLE001 - one response's failure is its own
                outcome = code.CodeOutcome(ERROR, detail=describe_exception(exc))
                self._failed(
                    "code", type(exc).__name__, outcome.detail, responses[i], references[i]
                )
            else:
                if outcome.status == code.ERROR:  # the sandbox failed: logged by it
                    self.stats["code_failed_sandbox"] += 1
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

    def worker_pids(self) -> list[int]:
        """Process ids of the math workers ([] before the first batch that needs them), for
        tests and diagnostics."""
        return self._math.worker_pids() if self._math is not None else []

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


def _code_outcome(response: Any, tests: Any, config: RewardConfig) -> code.CodeOutcome:
    """``code.code_outcome`` of one response (in a thread of the pool)."""
    return code.code_outcome(str(response), tests, config)

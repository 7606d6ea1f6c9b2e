"""Math reward: final answer after the thinking vs the reference, verified by Math-Verify.

Safety (model text is hostile input):

- The trainer process only runs the linear-time extraction and the static checks of
  ``megatron_rl.rewards.extraction``; anything long, deeply nested or with huge powers
  scores incorrect there, without parsing.
- Verification runs in worker processes (``megatron_rl.rewards.workers``) with a hard time
  limit measured by the parent, which SIGKILLs and replaces a stuck worker; this works from
  any thread of the trainer. Math-Verify's own signal-based limit is used inside the worker
  as a softer first limit (workers run tasks on their main thread, where signals work).
- Only ``LatexExtractionConfig`` is used. Math-Verify's ``ExprExtractionConfig`` hands the
  text to ``sympy.parse_expr``, which calls ``eval``, so it is never enabled. LaTeX goes
  through the ANTLR grammar of latex2sympy2; the one ``sympify`` on that path receives
  NUMBER tokens of the grammar (digits and a decimal point), never free text.
- Workers run under an audit-hook guard that refuses process creation, sockets and file
  writes, and records any attempt (``TaskResult.blocked``).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.extraction import (
    extract_math_answer,
    integer_answer,
    last_boxed,
    unsafe_reason,
)

logger = logging.getLogger(__name__)

_DEFAULT_POOL: Any = None
_DEFAULT_POOL_LOCK = threading.Lock()


def reference_answer(answer: str) -> str:
    """The reference as the verifier sees it: the content of its last ``\\boxed{}`` if any."""
    boxed = last_boxed(answer) if "\\boxed" in answer or "\\fbox" in answer else None
    return (boxed if boxed is not None else answer).strip().strip("$").strip()


def prepare(response: str, answer: str, config: RewardConfig) -> float | tuple[str, str]:
    """Decide a response in the trainer process when that is safe and cheap.

    Returns the reward when it is decided here (no answer, unsafe answer, or both answers
    plain integers), else the ``(prediction, reference)`` pair a worker must verify.
    """
    prediction = extract_math_answer(response, config)
    if prediction is None:
        return config.incorrect_reward
    reason = unsafe_reason(prediction, config)
    if reason is not None:
        logger.debug("answer rejected before parsing: %s", reason)
        return config.incorrect_reward
    reference = reference_answer(answer)
    predicted_int, reference_int = integer_answer(prediction), integer_answer(reference)
    if predicted_int is not None and reference_int is not None:
        return config.correct_reward if predicted_int == reference_int else config.incorrect_reward
    return prediction, reference


def load_verifier() -> None:
    """Worker initialiser: import Math-Verify and warm up its parser and sympy paths.

    The warm-up imports the modules that sympy loads lazily, before the worker's guard is
    installed and outside any task's time.
    """
    for name in ("math_verify", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for prediction, reference in (
        ("\\frac{1}{2}", "0.5"),
        ("(1,2]", "(1, 2]"),
        ("\\{1,2\\}", "\\{2,1\\}"),
        ("x^2+2x+1", "(x+1)^2"),
        ("30^\\circ", "\\sqrt{2}\\pi"),
    ):
        verify(prediction, reference, 0)


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str, timeout: int | None) -> Any:
    from math_verify import LatexExtractionConfig, parse

    return parse(
        "\\boxed{" + reference + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=timeout,
    )


def verify(prediction: str, reference: str, timeout_s: float) -> bool:
    """Math-Verify equivalence of two extracted answers. Runs inside a worker process.

    ``timeout_s`` >= 2 also arms Math-Verify's own (signal-based) limits at
    ``int(timeout_s) - 1`` seconds; the hard limit is the worker pool's.
    """
    from math_verify import LatexExtractionConfig, parse
    from math_verify import verify as math_verify

    timeout = int(timeout_s) - 1 if timeout_s >= 2 else None
    gold = _parse_reference(reference, timeout)
    if not gold:
        return False
    target = parse(
        "\\boxed{" + prediction + "}",
        extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
        parsing_timeout=timeout,
    )
    if not target:
        return False
    return bool(math_verify(gold, target, timeout_seconds=timeout))


def score(response: str, answer: str) -> float:
    """Reward of one math response against its reference answer (+1 / -1 by default).

    Safe on hostile input: verification happens in an isolated, time-limited worker of a
    process-wide ``RewardPool`` with the default ``RewardConfig`` (started on first use).
    Batch callers should use ``RewardPool.score_batch`` (parallel workers).
    """
    global _DEFAULT_POOL
    with _DEFAULT_POOL_LOCK:
        if _DEFAULT_POOL is None:
            import atexit

            from megatron_rl.rewards.pool import RewardPool

            _DEFAULT_POOL = RewardPool(RewardConfig(kind="math", num_workers=1))
            atexit.register(_DEFAULT_POOL.close)
        pool = _DEFAULT_POOL
    return pool.score_batch([response], [answer])[0]

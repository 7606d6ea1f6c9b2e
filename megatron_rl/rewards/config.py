"""Recipe-facing configuration of the verifiers (imports no torch).

Defaults follow ScaleRL (docs/paper.md section 2): reward +1 / -1 by answer verification after
stripping the thinking. Every verification has a hard time limit: math runs in worker
processes that are killed on timeout, code runs in a sandboxed subprocess (a bubblewrap box,
``megatron_rl.rewards.isolation``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_rl.config.errors import ConfigError

REWARD_KINDS: tuple[str, ...] = ("math", "code")
# An answer tag's name: "answer" for <answer>...</answer>; empty for none.
_TAG_NAME_RE = re.compile(r"(?:[A-Za-z][A-Za-z0-9_-]{0,31})?")


@dataclass
class RewardConfig:
    """How responses are verified and scored.

    Attributes:
        kind: verifier: "math" (the final answer), "code" (a program against tests), or the
            name of an installed reward plug-in (``megatron_rl.rewards.registry``).
        correct_reward: reward of a verified response (ScaleRL: +1).
        incorrect_reward: reward of anything else, including timeouts and hostile input (-1).
        require_think_end: a response must close its thinking with ``think_end_tag``; one that
            never does scores incorrect. False: the whole response is the answer part.
        think_end_tag: end of the thinking section; only the text after its last occurrence
            is verified.
        answer_pattern: a custom regex whose group 1 is the answer when there is no
            ``\\boxed{}`` (its last match near the end counts); empty: none.
        stated_answer: without a ``\\boxed{}`` (or an ``answer_pattern`` match), read the
            answer stated after the word "answer" ("The final answer is $X$. I hope it is
            correct.", "Answer: 42", "**Final Answer:** $\\frac12$"); see
            ``stated.stated_answer``.
        answer_tag: name of an answer tag (R1-Zero's template: ``<answer>...</answer>``).
            When the text after the thinking has a ``<answer_tag>``, only the content of the
            last one is read (to its end when it never closes), by the same steps (box,
            pattern, stated answer), else all of it is the answer. Responses without the
            tag are read as before, so the default works for boxed and tagged outputs alike.
            Empty: no tag.
        num_workers: verifier processes (math) / concurrent sandboxes (code).
        timeout_s: hard CPU-time limit of one math verification (the worker is killed), so
            that load on the machine does not turn correct answers into timeouts.
        wall_timeout_s: hard wall-clock limit of one math verification (a backstop).
        worker_memory_mb: address-space limit of a math worker process (0 = none).
        max_response_chars: longer responses score incorrect without being parsed.
        max_answer_chars: longer extracted answers score incorrect without being parsed.
        max_nesting_depth: deeper bracket nesting in an answer scores incorrect.
        max_exponent: a power whose exponent is a literal above this, or is itself a power,
            scores incorrect (``9^{9^{9^9}}`` would never finish evaluating).
        max_number_digits: an integer literal with more digits scores incorrect.
        max_factorial: a factorial of a literal above this scores incorrect.
        code_test_timeout_s: CPU-time limit of one program run on one test (a run over it
            fails as ``timeout_cpu``, as a judge's time limit). CPU time, not wall-clock time,
            so that load on the machine does not change a verdict; starting the box is not
            counted.
        code_wall_timeout_s: wall-clock backstop of one run (a program that sleeps or waits
            spends no CPU time); a run stopped by it is reported as ``timeout_wall`` (scored
            incorrect, counted apart from wrong answers). Starting the box is not counted.
        code_memory_mb: address-space limit of the sandboxed program.
        code_max_output_bytes: size limit of the sandboxed program's output, of each file it
            writes, and of its whole writable directory.
        code_max_chars: longer extracted programs score incorrect.
        code_sandbox_uid: uid/gid of the sandboxed program (65534 = nobody); a root trainer
            starts the sandbox as this user. Never 0.
        code_bwrap: the bubblewrap executable (a name on PATH or a path).
        code_allow_unsafe_sandbox: where no bubblewrap box can be set up (bwrap missing, user
            namespaces disabled), run model-written programs anyway, with resource limits and
            a Python audit hook only (no security boundary; logged as a warning whenever a
            reward pool starts). False: code rewards refuse to start there.
        python_executable: interpreter of the sandboxed programs (bound read-only into the
            box with its prefixes); empty = this interpreter, or when the sandbox user cannot
            reach it (a Python under /root), the system's python3.X of the same version.
        max_error_fraction: training stops when scoring fails on more than this fraction
            of the responses of one batch (a training step's, or a validation pass's).
            Scoring one response fails when the verifier raises on it, the code sandbox
            fails, or its math worker dies twice: that response alone scores
            ``incorrect_reward`` (status "error" or "crashed"), is counted in the
            ``reward_errors`` metric and the run goes on, unless so many fail that the
            reward itself is broken. 1: never stop; 0: stop at the first failure.
    """

    kind: str = "math"
    correct_reward: float = 1.0
    incorrect_reward: float = -1.0
    require_think_end: bool = True
    think_end_tag: str = "</think>"
    answer_pattern: str = ""
    stated_answer: bool = True
    answer_tag: str = "answer"
    num_workers: int = 2
    timeout_s: float = 5.0
    wall_timeout_s: float = 30.0
    worker_memory_mb: int = 2048
    max_response_chars: int = 262_144
    max_answer_chars: int = 1000
    max_nesting_depth: int = 16
    max_exponent: int = 100_000
    max_number_digits: int = 400
    max_factorial: int = 1000
    code_test_timeout_s: float = 6.0
    code_wall_timeout_s: float = 30.0
    code_memory_mb: int = 1024
    code_max_output_bytes: int = 8 * 1024 * 1024
    code_max_chars: int = 100_000
    code_sandbox_uid: int = 65534
    code_bwrap: str = "bwrap"
    code_allow_unsafe_sandbox: bool = False
    python_executable: str = ""
    max_error_fraction: float = 0.5

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field."""
        from megatron_rl.rewards.registry import kinds

        if self.kind not in kinds():
            raise ConfigError(
                "kind",
                f"must be one of {kinds()} (the built-ins and the installed reward plug-ins, "
                f"entry point group megatron_rl.rewards), got {self.kind!r}",
            )
        for name in ("correct_reward", "incorrect_reward"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ConfigError(name, f"must be finite, got {value!r}")
        if self.correct_reward <= self.incorrect_reward:
            raise ConfigError(
                "correct_reward",
                f"{self.correct_reward} must be greater than reward.incorrect_reward "
                f"({self.incorrect_reward})",
            )
        for name in ("require_think_end", "stated_answer"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.think_end_tag, str) or not self.think_end_tag:
            raise ConfigError(
                "think_end_tag", f"must be a non-empty string, got {self.think_end_tag!r}"
            )
        self._validate_pattern()
        if not isinstance(self.answer_tag, str) or not _TAG_NAME_RE.fullmatch(self.answer_tag):
            raise ConfigError(
                "answer_tag",
                "must be empty or a tag name (a letter, then up to 31 letters, digits, '_' or "
                f"'-'), got {self.answer_tag!r}",
            )
        for name in ("timeout_s", "wall_timeout_s", "code_test_timeout_s", "code_wall_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 3600:
                raise ConfigError(name, f"must be a number of seconds in (0, 3600], got {value!r}")
        if self.wall_timeout_s < self.timeout_s:
            raise ConfigError(
                "wall_timeout_s",
                f"{self.wall_timeout_s} must be >= reward.timeout_s ({self.timeout_s})",
            )
        if self.code_wall_timeout_s < self.code_test_timeout_s:
            raise ConfigError(
                "code_wall_timeout_s",
                f"{self.code_wall_timeout_s} must be >= reward.code_test_timeout_s "
                f"({self.code_test_timeout_s})",
            )
        positive_ints = (
            "num_workers",
            "max_response_chars",
            "max_answer_chars",
            "max_nesting_depth",
            "max_exponent",
            "max_number_digits",
            "max_factorial",
            "code_memory_mb",
            "code_max_output_bytes",
            "code_max_chars",
        )
        for name in positive_ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive int, got {value!r}")
        if not isinstance(self.worker_memory_mb, int) or self.worker_memory_mb < 0:
            raise ConfigError(
                "worker_memory_mb", f"must be an int >= 0, got {self.worker_memory_mb!r}"
            )
        if not isinstance(self.code_sandbox_uid, int) or self.code_sandbox_uid <= 0:
            raise ConfigError(
                "code_sandbox_uid",
                f"must be a positive int (not root), got {self.code_sandbox_uid!r}",
            )
        for name in ("python_executable", "code_bwrap"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(name, f"must be a string, got {getattr(self, name)!r}")
        fraction = self.max_error_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ConfigError("max_error_fraction", f"must be a number, got {fraction!r}")
        if not (math.isfinite(fraction) and 0 <= fraction <= 1):
            raise ConfigError("max_error_fraction", f"must be in [0, 1], got {fraction!r}")
        if not isinstance(self.code_allow_unsafe_sandbox, bool):
            raise ConfigError(
                "code_allow_unsafe_sandbox",
                f"must be a bool, got {self.code_allow_unsafe_sandbox!r}",
            )

    def _validate_pattern(self) -> None:
        if not isinstance(self.answer_pattern, str):
            raise ConfigError("answer_pattern", f"must be a string, got {self.answer_pattern!r}")
        if not self.answer_pattern:
            return
        try:
            compiled = re.compile(self.answer_pattern)
        except re.error as exc:
            raise ConfigError("answer_pattern", f"not a valid regex: {exc}") from exc
        if compiled.groups < 1:
            raise ConfigError("answer_pattern", "must have a capture group (group 1 is the answer)")

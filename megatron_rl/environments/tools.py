"""Running tool calls: model code in the code sandbox, the output cut to a token budget, and
the calls of many episodes at once off the caller's thread.

Where tool code runs. Exactly where the reward pool runs model-written code
(``RewardPool._score_code``): each program in its own OS box process
(``megatron_rl.rewards.sandbox.ProgramSession``: bubblewrap, never root, no network, its own
pid namespace, CPU-time / memory / output-size limits, SIGKILLed at the wall-clock limit),
driven by a thread that only waits on it. ``ToolExecutor`` is that set of threads for tool
calls: the rollout loop submits a step and collects its future, so neither the trainer's main
thread nor an engine ever waits on a tool, and a tool that hangs or floods its output is cut
off by the sandbox's limits and reported (``ToolResult.outcome``). The reward pool's math
workers (``rewards.workers.WorkerPool``) cannot host tool calls: their guard refuses process
creation, so they could not start a box, and running the code in the worker itself would
drop the OS isolation.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from megatron_rl.environments.formats import ToolCall
from megatron_rl.environments.protocol import Environment, ToolResult
from megatron_rl.rewards.code import TIMEOUT_CPU, TIMEOUT_WALL
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import box_for
from megatron_rl.rewards.sandbox import SandboxResult, run_program

logger = logging.getLogger(__name__)
# A tool call over its CPU time or its wall time: reported to the model as a timeout.
SANDBOX_TIMEOUTS = (TIMEOUT_CPU, TIMEOUT_WALL)

# What CPython writes when a write runs into RLIMIT_FSIZE (it ignores SIGXFSZ).
_FILE_TOO_LARGE = "[Errno 27] File too large"
# Traceback frames of the sandbox's harness (run from ``-c``: file "<string>"): noise to the
# model, whose own frames are those of main.py.
_HARNESS_FRAME = re.compile(r'^  File "<string>", line \d+, in .*\n', re.MULTILINE)


def truncate_to_tokens(text: str, max_tokens: int, tokenizer: Any) -> tuple[str, bool]:
    """``text`` cut to about ``max_tokens`` tokens of ``tokenizer``: its first and last
    halves with a marker naming how many tokens were left out between them (a traceback's
    end is where the error is). Returns (text, whether it was cut)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text, False
    head = max_tokens // 2
    tail = max_tokens - head
    dropped = len(ids) - head - tail
    marker = f"\n[... {dropped} tokens of output truncated ...]\n"
    tail_text = tokenizer.decode(ids[len(ids) - tail :]) if tail else ""
    return tokenizer.decode(ids[:head]) + marker + tail_text, True


def program_output(result: SandboxResult) -> str:
    """What a program showed: its stdout, then its stderr (a traceback, without the
    sandbox harness's frames) when it has one."""
    stderr = _HARNESS_FRAME.sub("", result.stderr)
    if stderr and result.stdout and not result.stdout.endswith("\n"):
        return result.stdout + "\n" + stderr
    return result.stdout + stderr


def run_python(code: str, config: RewardConfig, max_tokens: int, tokenizer: Any) -> ToolResult:
    """Run ``code`` as a script in its own sandbox box (``config``: the box and the limits,
    ``code_test_timeout_s`` per run) and report it: outcome timeout (over the time limit),
    truncated (over ``code_max_output_bytes`` or ``max_tokens``), error (an exception or a
    non-zero exit; the box failing to start) or ok; the output cut to ``max_tokens``."""
    result = run_program(code, "", config)
    output = program_output(result)
    flooded = (
        len(result.stdout.encode("utf-8", errors="replace")) >= config.code_max_output_bytes
        or _FILE_TOO_LARGE in result.stderr
    )
    timed_out = result.status in SANDBOX_TIMEOUTS
    if timed_out:
        output += f"\nTimeoutError: stopped after {config.code_test_timeout_s:g} s\n"
    elif flooded:
        output += f"\n[output over {config.code_max_output_bytes} bytes: the program was cut]\n"
    elif result.status == "error":
        logger.warning("tool sandbox failed to start: %s", result.stderr.strip()[:300])
        output = "Error: the sandbox failed to start\n"
    output, cut = truncate_to_tokens(output, max_tokens, tokenizer)
    if timed_out:
        outcome = "timeout"
    elif flooded or cut:
        outcome = "truncated"
    elif result.status == "ok":
        outcome = "ok"
    else:
        outcome = "error"
    return ToolResult(outcome, output, result.elapsed_s)


class ToolExecutor:
    """Runs environment steps concurrently, each on a thread that waits on its sandbox.

    Args:
        num_workers: steps running at once (``rollout.environment.tool_workers``).
        config: the sandbox settings, checked at start (the pool refuses to start where no
            box can be set up and the unsafe mode is off, as the code reward does).

    ``submit`` returns a future of ``Environment.step``'s (result, done); it never fails
    with the tool's exception (``step`` reports those). Use as a context manager or call
    ``close()``.
    """

    def __init__(self, num_workers: int, config: RewardConfig) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        box_for(config, announce=True)
        self._executor = ThreadPoolExecutor(num_workers, "tool-call")
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self.submitted = 0

    def submit(self, environment: Environment, call: ToolCall) -> Future[tuple[ToolResult, bool]]:
        """Run ``environment.step(call)`` on a tool thread."""
        with self._lock:
            self.submitted += 1
            future = self._executor.submit(environment.step, call)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def map(self, steps: Sequence[tuple[Environment, ToolCall]]) -> list[tuple[ToolResult, bool]]:
        """Run several steps at once; their results in order."""
        futures = [self.submit(environment, call) for environment, call in steps]
        return [future.result() for future in futures]

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the queued steps, wait up to ``timeout`` seconds for the running ones (each
        is bounded by its sandbox's limits, ``rollout.environment.tool_timeout_s``, at most
        an hour) and stop. A stop on a signal must fit the
        signal's window: running every queued call first took minutes (hundreds of calls
        queued behind blocking tools), past the window, so the job was killed, not requeued.
        """
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            running = list(self._pending)
        _, left = wait(running, timeout=timeout)
        if left:  # their boxes die with this process (a death signal, as every box has)
            logger.warning(
                "%d tool calls still running after %.0f s at shutdown", len(left), timeout
            )

    def __enter__(self) -> ToolExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Synthetic verifiable task for the embedded default: integer arithmetic with a scratchpad.

Each problem is short text such as ``47+85`` with an exact integer answer (``132``) and a
worked solution in the response format the model must learn, a column-arithmetic
scratchpad inside the thinking section followed by the boxed answer::

    <think>7+5=12,4+8+1=13</think>\\boxed{132}

The scratchpad goes from the least significant digit up; each step shows its full sum (the
carry is the leading digit), so the answer is the last step's sum followed by the last
digits of the earlier steps in reverse. Problems and solutions are tiny on purpose: at the
lowest difficulty (1-digit addition) a problem plus its solution is under 20 characters,
so a character-level model of ~1M parameters learns the task on a CPU in minutes (a short
supervised warm start on ``solution``, then RL on the reward).

The file written is JSON lines with Polaris-like fields (``problem``, ``answer``) plus
``solution``, ``operation`` and ``digits``, read by the same loaders as real datasets.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import tempfile
from dataclasses import asdict
from pathlib import Path

from megatron_rl.data.config import SyntheticConfig

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
_SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}


def _digits_low_first(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


def scratchpad_add(a: int, b: int) -> str:
    """Column addition of non-negative ints, low digit first: ``7+5=12,4+8+1=13``."""
    xs, ys = _digits_low_first(a), _digits_low_first(b)
    width = max(len(xs), len(ys))
    xs, ys = xs + [0] * (width - len(xs)), ys + [0] * (width - len(ys))
    steps, carry = [], 0
    for x, y in zip(xs, ys):
        total = x + y + carry
        steps.append(f"{x}+{y}+1={total}" if carry else f"{x}+{y}={total}")
        carry = total // 10
    return ",".join(steps)


def scratchpad_sub(a: int, b: int) -> str:
    """Column subtraction ``a - b`` for ``a >= b >= 0``: ``15-7=8,8-1-4=3`` for 85-47.

    A step that borrows shows the top digit plus ten (``15-7``); the next step shows the
    borrow it repays (``8-1-4``).
    """
    assert a >= b >= 0
    xs, ys = _digits_low_first(a), _digits_low_first(b)
    ys += [0] * (len(xs) - len(ys))
    steps, borrow = [], 0
    for x, y in zip(xs, ys):
        top = f"{x}-1" if borrow else f"{x}"
        value = x - borrow - y
        if value < 0:
            top = f"1{x}-1" if borrow else f"1{x}"
            value += 10
            borrow = 1
        else:
            borrow = 0
        steps.append(f"{top}-{y}={value}")
    return ",".join(steps)


def scratchpad_mul(a: int, b: int) -> str:
    """Long multiplication. One-digit ``b``: digit steps with carries (``7*6=42,4*6+4=28``
    for 47*6); longer ``b``: one partial product per digit of ``b``, then their sum."""
    if b < 10:
        steps, carry = [], 0
        for x in _digits_low_first(a):
            total = x * b + carry
            steps.append(f"{x}*{b}+{carry}={total}" if carry else f"{x}*{b}={total}")
            carry = total // 10
        return ",".join(steps)
    partials = [a * d * 10**i for i, d in enumerate(_digits_low_first(b))]
    steps = [f"{a}*{d}={a * d}" for d in _digits_low_first(b)]
    steps.append("+".join(str(p) for p in partials) + f"={a * b}")
    return ",".join(steps)


def tool_solution(problem: str, answer: str, think_start: str, think_end: str) -> str:
    """A worked solution that asks the Python tool (ToRA's convention, the ``markdown``
    tool format): the program in a fenced ```python block, the stop at ```output, the
    program's output as the tool renders it (``MarkdownFormat.observation_text``), then the
    answer copied from it. In an episode the output block is the tool's (no loss there)."""
    call = f"```python\nprint({problem})\n```\n```output"
    return f"{think_start}{call}\n{answer}\n```\n{think_end}\\boxed{{{answer}}}"


def make_problem(
    a: int,
    b: int,
    operation: str,
    think_start: str = "<think>",
    think_end: str = "</think>",
    solution: str = "scratchpad",
) -> dict[str, object]:
    """One problem record: problem text, exact answer, worked solution (``solution``: its
    style, see ``SyntheticConfig``), metadata."""
    if operation == "add":
        result, pad = a + b, scratchpad_add(a, b)
    elif operation == "sub":
        result = a - b
        pad = scratchpad_sub(a, b) if a >= b else f"{b}-{a}:" + scratchpad_sub(b, a)
    elif operation == "mul":
        result, pad = a * b, scratchpad_mul(a, b)
    else:
        raise ValueError(f"unknown operation {operation!r}")
    answer = str(result)
    problem = f"{a}{_SYMBOLS[operation]}{b}"
    if solution == "tool":
        worked = tool_solution(problem, answer, think_start, think_end)
    else:
        worked = f"{think_start}{pad}{think_end}\\boxed{{{answer}}}"
    return {
        "problem": problem,
        "answer": answer,
        "solution": worked,
        "operation": operation,
        "digits": max(len(str(a)), len(str(b))),
    }


def _operand(rng: random.Random, digits: int) -> int:
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _space_size(config: SyntheticConfig) -> int:
    numbers = 10**config.max_digits - (
        0 if config.min_digits == 1 else 10 ** (config.min_digits - 1)
    )
    return len(config.operations) * numbers * numbers


def generate_problems(
    config: SyntheticConfig, think_start: str = "<think>", think_end: str = "</think>"
) -> list[dict[str, object]]:
    """``config.num_problems`` distinct problems (fewer if fewer exist), deterministic in
    ``config.seed``. Operand digit counts are uniform in [min_digits, max_digits]."""
    config.validate()
    rng = random.Random(f"synthetic-{config.seed}")
    target = min(config.num_problems, _space_size(config))
    seen: set[str] = set()
    problems: list[dict[str, object]] = []
    attempts = 0
    while len(problems) < target and attempts < 50 * target:
        attempts += 1
        operation = rng.choice(tuple(config.operations))
        a = _operand(rng, rng.randint(config.min_digits, config.max_digits))
        b = _operand(rng, rng.randint(config.min_digits, config.max_digits))
        record = make_problem(a, b, operation, think_start, think_end, config.solution)
        if record["problem"] not in seen:
            seen.add(str(record["problem"]))
            problems.append(record)
    if len(problems) < config.num_problems:
        logger.info("synthetic task: %d distinct problems (asked %d)", len(problems), target)
    return problems


def synthetic_dataset_path(
    config: SyntheticConfig,
    cache_dir: str = "",
    think_start: str = "<think>",
    think_end: str = "</think>",
) -> Path:
    """Where ``write_synthetic_dataset`` puts the file for these settings."""
    return cached_path("synthetic", [_FORMAT_VERSION, asdict(config), think_start, think_end],
                       cache_dir)  # fmt: skip


def cached_path(kind: str, settings: list, cache_dir: str = "") -> Path:
    """``<cache_dir>/<kind>-<digest of settings>.jsonl``: one file per generator settings."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "megatron_rl_data"
    return root / f"{kind}-{digest}.jsonl"


def write_jsonl(target: Path, records: list[dict]) -> None:
    """Write ``records`` as JSON lines, atomically (readers never see a partial file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, target)


def write_synthetic_dataset(
    config: SyntheticConfig,
    path: str | os.PathLike | None = None,
    cache_dir: str = "",
    think_start: str = "<think>",
    think_end: str = "</think>",
) -> Path:
    """Write the problems as JSON lines (atomically) and return the path.

    Without ``path`` the file goes to ``synthetic_dataset_path(...)`` and is reused when it
    already exists (same settings, same content).
    """
    if path is None:
        target = synthetic_dataset_path(config, cache_dir, think_start, think_end)
        if target.exists():
            return target
    else:
        target = Path(path)
    problems = generate_problems(config, think_start, think_end)
    write_jsonl(target, problems)
    logger.info("wrote %d synthetic problems to %s", len(problems), target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_rl.data.synthetic OUT.jsonl [--digits 1 2] [--ops add mul]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output .jsonl path")
    parser.add_argument("--ops", nargs="+", default=["add"], choices=sorted(_SYMBOLS))
    parser.add_argument("--digits", nargs=2, type=int, default=[1, 2], metavar=("MIN", "MAX"))
    parser.add_argument("--num-problems", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = SyntheticConfig(
        tuple(args.ops), args.digits[0], args.digits[1], args.num_problems, args.seed
    )
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    write_synthetic_dataset(config, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

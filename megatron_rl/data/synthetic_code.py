"""Synthetic code task for the embedded default: tiny stdin/stdout programs from templates.

Each problem asks for a program that reads two integers ``a b`` from stdin and prints an
expression of them, e.g. ``read a b; print max(a,b)+7``. Its tests are stdin/stdout pairs
drawn at random (``3 5`` -> ``12``), in the canonical test format of
``megatron_rl.rewards.code``, so the code verifier runs them in its sandbox like DeepCoder
tests. The worked solution (warm-start target) has an empty thinking section and the
program in a fenced block::

    <think></think>```py
    a,b=map(int,input().split())
    print(max(a,b)+7)
    ```

The file written is JSON lines with DeepCoder-like fields (``problem``, ``tests`` as a JSON
string) plus ``solution``, ``template`` and ``constant``, read by the same loaders as real
datasets (``format: deepcoder``).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict
from pathlib import Path

from megatron_rl.data.config import SyntheticCodeConfig
from megatron_rl.data.synthetic import cached_path, write_jsonl

logger = logging.getLogger(__name__)

_FORMAT_VERSION = 1
# template -> (expression with {k}, the function it computes)
EXPRESSIONS = {
    "sum": ("a+b+{k}", lambda a, b, k: a + b + k),
    "diff": ("a-b+{k}", lambda a, b, k: a - b + k),
    "max": ("max(a,b)+{k}", lambda a, b, k: max(a, b) + k),
    "min": ("min(a,b)+{k}", lambda a, b, k: min(a, b) + k),
    "prod": ("a*b+{k}", lambda a, b, k: a * b + k),
}
READ_INPUT = "a,b=map(int,input().split())"


def make_code_problem(
    template: str,
    k: int,
    tests: list[tuple[int, int]],
    think_start: str = "<think>",
    think_end: str = "</think>",
) -> dict[str, object]:
    """One problem record: problem text, tests (JSON), worked solution, metadata."""
    expression, fn = EXPRESSIONS[template]
    expression = expression.format(k=k)
    cases = [{"input": f"{a} {b}", "output": str(fn(a, b, k))} for a, b in tests]
    program = f"{READ_INPUT}\nprint({expression})\n"
    return {
        "problem": f"read a b; print {expression}",
        "tests": json.dumps(cases),
        "solution": f"{think_start}{think_end}```py\n{program}```",
        "template": template,
        "constant": k,
    }


def generate_code_problems(
    config: SyntheticCodeConfig, think_start: str = "<think>", think_end: str = "</think>"
) -> list[dict[str, object]]:
    """``config.num_problems`` distinct problems (fewer if fewer exist), deterministic in
    ``config.seed``: every (template, constant) pair once, in a seeded order."""
    config.validate()
    rng = random.Random(f"synthetic-code-{config.seed}")
    pairs = [(t, k) for t in config.templates for k in range(config.max_constant + 1)]
    rng.shuffle(pairs)
    problems = []
    for template, k in pairs[: config.num_problems]:
        tests = [
            (rng.randint(0, config.max_operand), rng.randint(0, config.max_operand))
            for _ in range(config.num_tests)
        ]
        problems.append(make_code_problem(template, k, tests, think_start, think_end))
    if len(problems) < config.num_problems:
        logger.info(
            "synthetic code task: %d distinct problems (asked %d)",
            len(problems),
            config.num_problems,
        )
    return problems


def write_synthetic_code_dataset(
    config: SyntheticCodeConfig,
    cache_dir: str = "",
    think_start: str = "<think>",
    think_end: str = "</think>",
) -> Path:
    """Write the problems as JSON lines (atomically, once per settings) and return the path."""
    settings = [_FORMAT_VERSION, asdict(config), think_start, think_end]
    target = cached_path("synthetic-code", settings, cache_dir)
    if target.exists():
        return target
    problems = generate_code_problems(config, think_start, think_end)
    write_jsonl(target, problems)
    logger.info("wrote %d synthetic code problems to %s", len(problems), target)
    return target

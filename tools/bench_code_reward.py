"""Code-reward cost: sandbox against plain python per test, where it goes, and throughput.

Each response is a correct stdin/stdout program (so every one of its tests runs), scored as
in training. All tests of a response run in one box (``sandbox.ProgramSession``).

Printed per mode:
- a start-up breakdown (medians): the interpreter alone (``python -I -c pass``), the
  ``setpriv`` launcher (a root trainer only), what the bubblewrap box adds around the
  interpreter, and one whole ``run_program`` of an empty program (box, interpreter,
  harness, limits, audit hook, files);
- per-test latency, one response at a time, with 1 and ``--tests`` tests per response:
  the sandboxed ``score_code`` against ``python3 -I -c program`` per test (no box, no
  limits, no harness), and their ratio;
- tests/s through ``RewardPool.score_batch`` with 1, 2 and 4 workers, with the CPU time per
  test of this process and its direct children.

Usage: python tools/bench_code_reward.py [--responses 24] [--tests 4] [--workers 1 2 4]
       [--latency-responses 12]
       [--unsafe]   (also time the unsafe mode, no bubblewrap box, to show the box's cost)
       [--parent-mb 2000]   (make this process as large as a trainer first: the cost of
                             starting a program can grow with the size of its parent)

The CPU times are of this process and of the bubblewrap processes it starts, which is where
the cost of starting a program from a large parent lands (page-table copies and teardown).
The programs inside the box are not in it: the box's own init reaps them, out of this
process's accounting; ``perf stat -e task-clock`` around the whole benchmark counts
everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import statistics
import subprocess
import time
from collections.abc import Callable

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards.code import score_code
from megatron_rl.rewards.isolation import BOX_DIR, as_user, box_for, source_fd
from megatron_rl.rewards.sandbox import capabilities, run_program

# A typical competitive-programming solution: parse input, a little work, print.
PROGRAM = """\
import sys
from collections import Counter
data = sys.stdin.read().split()
n = int(data[0])
values = list(map(int, data[1:1 + n]))
counts = Counter(values)
print(sum(values), max(counts.values()), sorted(set(values))[:3])
"""


def make_batch(responses: int, tests: int) -> tuple[list[str], list[list[dict[str, str]]]]:
    """``responses`` copies of the program, each with ``tests`` tests of its own."""
    texts, references = [], []
    for r in range(responses):
        cases = []
        for t in range(tests):
            values = [(r * 7 + t * 13 + i * i) % 50 for i in range(20 + t)]
            counts = max(values.count(v) for v in values)
            expected = f"{sum(values)} {counts} {sorted(set(values))[:3]}"
            cases.append(
                {"input": f"{len(values)}\n{' '.join(map(str, values))}\n", "output": expected}
            )
        texts.append(f"<think>easy</think>\n```python\n{PROGRAM}```\n")
        references.append(cases)
    return texts, references


def measure(
    config: RewardConfig, texts: list[str], references: list, repeats: int
) -> tuple[float, float, float]:
    """Best tests-per-second over ``repeats`` batches (the box is probed before timing), and
    the mean user and system CPU seconds per test (this process and its children)."""
    runs = sum(len(r) for r in references)
    best, user, system = 0.0, 0.0, 0.0
    with RewardPool(config) as pool:
        pool.score_batch(texts[:1], references[:1])  # warm-up: threads, page cache
        for _ in range(repeats):
            before, start = os.times(), time.perf_counter()
            rewards = pool.score_batch(texts, references)
            elapsed, after = time.perf_counter() - start, os.times()
            if rewards != [config.correct_reward] * len(texts):
                raise RuntimeError(f"the benchmark programs failed their tests: {rewards}")
            best = max(best, runs / elapsed)
            user += after.user + after.children_user - before.user - before.children_user
            system += after.system + after.children_system - before.system - before.children_system
    return best, user / (runs * repeats), system / (runs * repeats)


def _interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall-clock milliseconds of each ``fns[name]()``, called in turn ``repeats``
    times (interleaved, so that load changes on a shared machine hit all of them alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def latency(config: RewardConfig, texts: list[str], references: list) -> tuple[float, float]:
    """Median milliseconds per test, one response at a time: (sandboxed ``score_code``,
    plain ``python3 -I -c program`` per test with no box, no limits and no harness)."""
    python = box_for(config).python
    boxed, plain = [], []
    for text, cases in zip(texts, references):
        start = time.perf_counter()
        if score_code(text, cases, config) != config.correct_reward:
            raise RuntimeError("the benchmark program failed its tests in the sandbox")
        boxed.append(1000 * (time.perf_counter() - start) / len(cases))
        start = time.perf_counter()
        for case in cases:
            subprocess.run(
                [python, "-I", "-c", PROGRAM],
                input=case["input"].encode(),
                capture_output=True,
                check=True,
            )
        plain.append(1000 * (time.perf_counter() - start) / len(cases))
    return statistics.median(boxed), statistics.median(plain)


def breakdown(config: RewardConfig, repeats: int) -> dict[str, float]:
    """Median milliseconds of each layer of one sandboxed start: the interpreter alone,
    the launcher (``setpriv``, a root trainer only), the bubblewrap box around the
    interpreter, and one whole ``run_program`` of an empty program (harness, limits, audit
    hook, files)."""
    box = box_for(config)
    env = {"PATH": "/usr/bin:/bin", "HOME": BOX_DIR, "LANG": "C.UTF-8"}
    bare = [box.python, "-I", "-c", "pass"]
    fns: dict[str, Callable[[], object]] = {
        "true": lambda: subprocess.run(["/bin/true"]),
        "python": lambda: subprocess.run(bare),
        "run_program": lambda: run_program("pass\n", "", config),
    }
    if box.run_as is not None:
        launcher, user = as_user(["/bin/true"], box.run_as)
        fns["setpriv"] = lambda: subprocess.run(launcher, **user)
    if box.isolated:

        def boxed() -> None:
            main = source_fd("")
            try:
                command, user = as_user(box.command(bare, env, main, 1 << 20), box.run_as)
                subprocess.run(command, pass_fds=(main,), cwd="/", **user)
            finally:
                os.close(main)

        fns["boxed"] = boxed
    ms = _interleaved_ms(fns, repeats)
    out = {"python -I -c pass": ms["python"]}
    if "setpriv" in ms:
        out["setpriv (launcher)"] = ms["setpriv"] - ms["true"]
    if "boxed" in ms:
        out["bwrap box (+ launcher) around it"] = ms["boxed"] - ms["python"]
    out["harness, limits, hook, files"] = ms["run_program"] - ms.get("boxed", ms["python"])
    out["run_program('pass') in all"] = ms["run_program"]
    return out


def ballast(megabytes: int) -> bytearray:
    """``megabytes`` of touched memory: this process then has a trainer's page tables."""
    block = bytearray(megabytes << 20)
    block[::4096] = b"\1" * len(block[::4096])
    return block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=24)
    parser.add_argument("--tests", type=int, default=4)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--unsafe", action="store_true", help="also time the unsafe mode")
    parser.add_argument(
        "--latency-responses", type=int, default=12, help="responses timed one at a time"
    )
    parser.add_argument("--parent-mb", type=int, default=0, help="grow this process first")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="per test (s): a loaded machine is slow"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    memory = ballast(args.parent_mb)  # noqa: F841 - held until the end
    texts, references = make_batch(args.responses, args.tests)
    modes = {"bwrap box": RewardConfig(kind="code", code_test_timeout_s=args.timeout)}
    if args.unsafe:
        modes["unsafe (no box)"] = RewardConfig(
            kind="code",
            code_test_timeout_s=args.timeout,
            code_bwrap="",
            code_allow_unsafe_sandbox=True,
        )
    for mode, base in modes.items():
        report = capabilities(base)
        print(
            f"{mode}: python {report['python']}, uid {report['run_as_uid']}, "
            f"{args.responses} responses x {args.tests} tests per batch, parent "
            f"{args.parent_mb} MB larger"
        )
        for layer, ms in breakdown(base, 2 * args.latency_responses).items():
            print(f"  start-up breakdown: {layer:34s} {ms:6.1f} ms")
        for tests in sorted({1, args.tests}):
            boxed, plain = latency(base, *make_batch(args.latency_responses, tests))
            print(
                f"  per test, {tests} test(s) per response, one response at a time: sandbox "
                f"{boxed:6.1f} ms, plain python {plain:6.1f} ms, ratio {boxed / plain:4.2f}x"
            )
        for workers in args.workers:
            config = dataclasses.replace(base, num_workers=workers)
            rate, user, system = measure(config, texts, references, args.repeats)
            print(
                f"  {workers} worker(s): {rate:6.1f} tests/s, CPU per test: user "
                f"{1000 * user:5.1f} ms, system {1000 * system:5.1f} ms"
            )


if __name__ == "__main__":
    main()

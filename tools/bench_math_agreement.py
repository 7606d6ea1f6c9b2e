"""Agreement of the math reward with Math-Verify's own expected verdicts.

Scores every case of ``tests/data/math_verify_suite.jsonl`` (Math-Verify's public test
cases as realistic responses, built by ``tools/build_math_verify_suite.py``) with
``RewardPool`` and compares ``reward > 0`` with the case's expected verdict. Prints the
agreement overall and on responses that carry a ``\\boxed{}`` answer or a stated final
answer (the subset a reasoning model's reward is held to), the false positives (rewarded
where Math-Verify says wrong), and each disagreement with -v.

Usage: python tools/bench_math_agreement.py [--suite PATH] [--workers N] [-v]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SUITE = Path(__file__).resolve().parents[1] / "tests" / "data" / "math_verify_suite.jsonl"
ANSWERED = ("boxed", "stated")


def load_suite(path: Path = SUITE) -> list[dict]:
    """The suite's cases (the header line, a ``#`` comment, is skipped)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


def agreement(cases: list[dict], rewards: list[float]) -> dict[str, tuple[int, int]]:
    """{"overall" | "answered" | answer_form: (agreeing, total)} of rewards with expected."""
    counts: dict[str, list[int]] = {}
    for case, reward in zip(cases, rewards):
        agrees = int((reward > 0) == bool(case["expected"]))
        keys = ["overall", case["answer_form"]]
        if case["answer_form"] in ANSWERED:
            keys.append("answered")
        for key in keys:
            counts.setdefault(key, [0, 0])
            counts[key][0] += agrees
            counts[key][1] += 1
    return {key: (a, n) for key, (a, n) in counts.items()}


def main() -> int:
    from megatron_rl.rewards import RewardConfig, RewardPool

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", type=Path, default=SUITE)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    cases = load_suite(args.suite)
    started = time.monotonic()
    with RewardPool(RewardConfig(num_workers=args.workers)) as pool:
        rewards = pool.score_batch([c["response"] for c in cases], [c["reference"] for c in cases])
        stats = dict(pool.stats)
    elapsed = time.monotonic() - started
    counts = agreement(cases, rewards)
    labels = {
        "overall": "overall",
        "answered": "boxed or stated answer",
        "boxed": "  boxed",
        "stated": "  stated",
        "none": "no boxed or stated answer",
    }
    for key, label in labels.items():
        if key in counts:
            agree, total = counts[key]
            print(f"{label:<28} {agree:>4}/{total:<4} {agree / total:6.1%}")
    false_positives = sum(r > 0 and not c["expected"] for c, r in zip(cases, rewards))
    print(f"false positives (rewarded, Math-Verify says wrong): {false_positives}")
    print(f"{len(cases)} cases in {elapsed:.1f}s with {args.workers} workers; stats {stats}")
    if args.verbose:
        for case, reward in zip(cases, rewards):
            if (reward > 0) != bool(case["expected"]):
                response = case["response"].rsplit("</think>", 1)[-1].strip()
                print(
                    f"\n{case['id']} ({case['answer_form']}) expected {case['expected']} got {reward:+.0f}"
                )
                print(f"  reference: {case['reference'][:200]!r}")
                print(f"  response:  {response[-300:]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

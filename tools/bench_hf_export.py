"""Does an HF export during training slow the training down? (checkpoint.export_hf_every)

Runs the embedded default (recipes/tiny_cpu.yaml, shortened) with a checkpoint and an HF
export every ``--every`` steps and prints each step's time, marking the steps that triggered
an export and the median; the goal (issue 30, 2): the triggering step within 20% of the median.
On a 2-core CPU machine the export's conversion competes with the trainer and the engine for
the same cores (it runs at nice 10); a GPU node's host has cores to spare.

    .venv/bin/python tools/bench_hf_export.py [--steps 9] [--every 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    from megatron_rl.platform import LAUNCHER_VARS

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [
            sys.executable,
            "-m",
            "megatron_rl.cli",
            "train",
            str(ROOT / "recipes/tiny_cpu.yaml"),
        ]
        cmd += ["warm_start.steps=40", "data.val_size=16", "batch.prompts_per_step=4",
                "batch.samples_per_prompt=4", "validation.enabled=false", "logging.tensorboard=false",
                f"training.max_steps={args.steps}", f"checkpoint.every_steps={args.every}",
                f"checkpoint.export_hf_every={args.every}", "--run-dir", str(run_dir)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        records = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        steps = {r["step"]: r["step_seconds"] for r in records if "step_seconds" in r}
        exports = sorted(p.name for p in (run_dir / "hf").iterdir())
    median = statistics.median(steps.values())
    print(f"exports: {', '.join(exports)}")
    print("step  seconds  / median")
    for step, seconds in sorted(steps.items()):
        mark = "  <- triggers an export" if step % args.every == 0 else ""
        mark = mark or (
            "  (an export runs)" if step > args.every and step % args.every == 1 else ""
        )
        print(f"{step:4d}  {seconds:7.2f}  {seconds / median:6.2f}{mark}")
    print(f"median step {median:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

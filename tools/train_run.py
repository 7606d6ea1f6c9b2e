"""What the benchmarks share: run ``megatron-rl train`` as a user would, read its records.

The run is a child process of its own (one rank: the caller's torchrun variables are dropped,
else the child would try to join the caller's world), started from the repository root; a
failing run ends the benchmark with the command and the tail of its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_rl.platform import LAUNCHER_VARS

ROOT = Path(__file__).resolve().parents[1]


def train(recipe: str | Path, overrides: Sequence[str], run_dir: Path, **env: str) -> list[dict]:
    """Run ``megatron-rl train recipe overrides --run-dir run_dir`` (``env``: extra
    environment variables, set where not already set); its ``metrics.jsonl`` records."""
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    for key, value in env.items():
        environ.setdefault(key, value)
    recipe, run_dir = Path(recipe).resolve(), Path(run_dir).resolve()  # the caller's cwd
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(recipe), *overrides]
    cmd += ["--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def step_records(records: list[dict], skip: int = 0) -> list[dict]:
    """The training steps' records (those with ``step_seconds``), after the first ``skip``."""
    return [r for r in records if "step_seconds" in r][skip:]

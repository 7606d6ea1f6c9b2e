"""Does a helper process exit once the process that started it is SIGKILLed? (tests)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.platform import LAUNCHER_VARS


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whatever PID 1 is, or not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_helper_exits_with_parent(
    script: str, args: list[str], workdir: Path, what: str, within: float, **env: str
) -> None:
    """Run ``script`` (it prints ``HELPER_PID <pid>`` once its helper process runs, then
    waits), SIGKILL it, and fail unless the helper is gone within ``within`` seconds."""
    path = workdir / "parent.py"
    path.write_text(script)
    environ = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    parent = subprocess.Popen(
        [sys.executable, str(path), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**environ, **env},
    )
    try:
        line = ""
        while not line.startswith("HELPER_PID"):  # libraries may log to stdout too
            line = parent.stdout.readline()
            assert line, "the parent script ended early"
        helper = int(line.split()[1])
        assert running(helper)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and running(helper):
            time.sleep(0.2)
        if running(helper):
            os.kill(helper, signal.SIGKILL)
            pytest.fail(f"{what} outlived its killed parent by {within:g} s")
    finally:
        parent.kill()

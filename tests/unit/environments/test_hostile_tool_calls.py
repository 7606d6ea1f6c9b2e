"""Hostile tool calls (the sandbox suite's attacks, as a model's tool call would make them),
run the way the rollout loop runs them: ``python_tool`` steps on ``ToolExecutor`` threads.

Every attack is contained (its effect outside the box does not happen), reported as the
tool's outcome, ends within its limit, and never blocks the caller. The containment attacks
also run with the audit hook off: the OS box must hold alone (as in
``tests/unit/rewards/test_rewards_sandbox.py``).
"""

from __future__ import annotations

import os
import secrets
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from megatron_rl.data.prompts import Prompt
from megatron_rl.environments.config import EnvironmentConfig
from megatron_rl.environments.formats import ToolCall
from megatron_rl.environments.protocol import Environment, EnvironmentContext, ToolResult
from megatron_rl.environments.python_tool import PythonToolEnvironment
from megatron_rl.environments.tools import ToolExecutor
from megatron_rl.rewards import sandbox
from megatron_rl.rewards.config import RewardConfig
from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for

ROOT = Path(__file__).resolve().parents[3]
REWARD = RewardConfig(kind="math", num_workers=1)
TIMEOUT_S = 2.0
# Start-up of bwrap + Python on a busy 2-core machine, on top of the time limit.
SLACK_S = 10.0
CONFIG = EnvironmentConfig(
    name="python_tool",
    max_tool_output_tokens=1024,
    tool_timeout_s=TIMEOUT_S,
    tool_max_output_bytes=64 * 1024,
)


@pytest.fixture(scope="module", autouse=True)
def _box():
    try:
        box_for(REWARD)
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")


@pytest.fixture(params=["audit hook", "box alone"])
def hook(request, monkeypatch):
    if request.param == "box alone":
        monkeypatch.setattr(sandbox, "_AUDIT_HOOK", False)
    return request.param


@pytest.fixture(scope="module")
def executor():
    with ToolExecutor(2, REWARD) as pool:
        yield pool


def _step(executor, tokenizer, code: str) -> tuple[ToolResult, float]:
    env = PythonToolEnvironment(EnvironmentContext(CONFIG, REWARD, tokenizer, max_turns=4))
    env.reset(Prompt(0, "q", answer="1"))
    started = time.monotonic()
    future = executor.submit(env, ToolCall(code))
    assert time.monotonic() - started < 0.5, "submit waited on the tool"
    result, done = future.result(timeout=TIMEOUT_S + 2 * SLACK_S)
    assert not done
    return result, time.monotonic() - started


def _children() -> set[int]:
    """Live (not zombie) processes whose parent is this one."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == os.getpid() and stat[0] != "Z":
            found.add(int(entry))
    return found


@pytest.mark.timeout(60)
def test_fork_bomb_is_contained(executor, char_tokenizer, hook):
    before = _children()
    code = "import os\nwhile True:\n    os.fork()\n"
    result, elapsed = _step(executor, char_tokenizer, code)
    assert result.outcome == "error", result
    # Refused by the audit hook, or by the box's seccomp filter without it.
    refusals = (
        "blocked by the reward sandbox",
        "PermissionError: [Errno 1] Operation not permitted",
    )
    assert any(refusal in result.output for refusal in refusals), result.output
    assert elapsed < TIMEOUT_S + SLACK_S
    assert _children() <= before  # nothing left running


@pytest.mark.timeout(60)
def test_trainer_files_are_out_of_reach(executor, char_tokenizer, hook):
    run_dir = Path(tempfile.mkdtemp(prefix="mrl-tool-run-"))
    run_dir.chmod(0o755)
    secret = "run-secret-" + secrets.token_hex(8)
    (run_dir / "metrics.jsonl").write_text(secret)
    (run_dir / "metrics.jsonl").chmod(0o644)
    code = (
        "import os\n"
        f"for path in [{str(run_dir / 'metrics.jsonl')!r}, {str(ROOT / 'setup.py')!r}]:\n"
        "    try:\n"
        "        print(open(path).read()[:200])\n"
        "    except OSError as exc:\n"
        "        print('refused', type(exc).__name__)\n"
        f"print(os.listdir({str(ROOT)!r}))\n"
    )
    result, _ = _step(executor, char_tokenizer, code)
    assert secret not in result.output and "megatron-rl" not in result.output
    assert result.output.count("refused FileNotFoundError") == 2, result.output
    assert result.outcome == "error" and "FileNotFoundError" in result.output  # the listdir


@pytest.mark.timeout(60)
def test_network_is_unreachable(executor, char_tokenizer, hook):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        f"s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "s.sendall(b'exfiltrate')\nprint('connected')\n"
    )
    try:
        result, _ = _step(executor, char_tokenizer, code)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.outcome == "error" and "connected" not in result.output


@pytest.mark.timeout(60)
def test_huge_output_is_cut_and_reported(executor, char_tokenizer):
    result, elapsed = _step(executor, char_tokenizer, "while True:\n    print('x' * 10000)\n")
    assert result.outcome == "truncated"
    assert "tokens of output truncated" in result.output
    # The model sees about its token budget (a marker between head and tail), not 64 KiB.
    assert len(char_tokenizer.encode(result.output, add_special_tokens=False)) < 1024 + 80
    assert elapsed < TIMEOUT_S + SLACK_S


@pytest.mark.timeout(60)
def test_sleeping_forever_times_out(executor, char_tokenizer):
    before = _children()
    result, elapsed = _step(
        executor, char_tokenizer, "import time\nprint('start', flush=True)\ntime.sleep(10**6)\n"
    )
    assert result.outcome == "timeout"
    assert (
        result.output.startswith("start\n") and "TimeoutError: stopped after 2 s" in result.output
    )
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + SLACK_S
    assert _children() <= before


class _Recorder(Environment):
    def run(self, code: str) -> ToolResult:
        return ToolResult("ok", threading.current_thread().name)


@pytest.mark.timeout(30)
def test_steps_run_on_tool_threads_not_the_callers(executor):
    env = _Recorder(EnvironmentContext(CONFIG, REWARD, None, max_turns=2))
    env.reset(Prompt(0, "q", answer="1"))
    ((result, _),) = executor.map([(env, ToolCall("x"))])
    assert (
        result.output.startswith("tool-call") and result.output != threading.current_thread().name
    )

"""Code reward: test parsing, output comparison, and the sandbox against hostile programs."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time

import pytest

from megatron_rl.rewards import RewardConfig, RewardPool
from megatron_rl.rewards import code as code_reward
from megatron_rl.rewards.code import CodeTest, outputs_match, parse_tests, values_match
from megatron_rl.rewards.sandbox import capabilities, run_program

CONFIG = RewardConfig(kind="code", code_test_timeout_s=1.0, code_memory_mb=512, num_workers=2)

ADD_TESTS = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2\n", "output": "8"}]
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def respond(program: str) -> str:
    return f"<think>plan</think>Here it is:\n```python\n{program}```\n"


def test_correct_program_passes_all_tests():
    assert code_reward.score_code(respond(ADD_PROGRAM), ADD_TESTS, CONFIG) == 1.0


def test_wrong_or_missing_program_fails():
    wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
    assert code_reward.score_code(respond(wrong), ADD_TESTS, CONFIG) == -1.0
    assert code_reward.score_code("<think>x</think> no code", ADD_TESTS, CONFIG) == -1.0
    # The program sits inside an unclosed thinking section: no answer.
    assert code_reward.score_code(f"<think>```python\n{ADD_PROGRAM}```", ADD_TESTS, CONFIG) == -1.0


def test_functional_tests_call_the_named_function():
    program = "class Solution:\n    def twoSum(self, a, b):\n        return [a, b + 1]\n"
    lcb = [{"input": "1\n2", "output": "[1, 3]", "testtype": "functional"}]
    tests = {"tests": json.dumps(lcb), "fn_name": "twoSum"}
    assert code_reward.score_code(respond(program), tests, CONFIG) == 1.0
    taco = {"inputs": [[1, 2]], "outputs": [[[1, 3]]], "fn_name": "twoSum"}
    assert code_reward.score_code(respond(program), taco, CONFIG) == 1.0
    plain = "def f(x):\n    return x * 2\n"
    assert (
        code_reward.score_code(
            respond(plain), {"tests": {"inputs": [[4]], "outputs": [8]}, "fn_name": "f"}, CONFIG
        )
        == 1.0
    )


def test_parse_tests_formats():
    canonical = [CodeTest("1\n", "2\n")]
    assert parse_tests([{"input": "1\n", "output": "2\n"}]) == canonical
    assert parse_tests(json.dumps({"inputs": ["1\n"], "outputs": ["2\n"]})) == canonical
    lcb = [
        {"input": "[1]\n2", "output": "3", "testtype": "functional", "metadata": {"func_name": "g"}}
    ]
    assert parse_tests(lcb) == [CodeTest("[[1], 2]", "3", "g")]
    with pytest.raises(ValueError):
        parse_tests("not json")
    with pytest.raises(ValueError):
        parse_tests([{"input": "1"}])
    with pytest.raises(ValueError):
        parse_tests([{"input": "1", "output": "2", "testtype": "functional"}])


def test_output_comparison():
    assert outputs_match("1 2\n3  \n\n", "1 2\n3")
    assert outputs_match("0.3333333\n", "0.33333333")
    assert not outputs_match("1 2", "1 3")
    assert values_match([1, 2.0000001], [1, 2])
    assert values_match(5, [5])
    assert not values_match(True, 1)


HOSTILE = {
    "infinite loop": "while True:\n    pass\n",
    "sleep": "import time\ntime.sleep(60)\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "subprocess": "import subprocess\nsubprocess.run(['sleep', '60'])\n",
    "os.system": "import os\nos.system('sleep 60')\n",
    "memory hog": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))\n",
    "huge output": "while True:\n    print('x' * 100000)\n",
    "ctypes": "import ctypes\nctypes.CDLL(None).system(b'sleep 60')\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_programs_are_stopped(name):
    program = HOSTILE[name] + ADD_PROGRAM
    started = time.monotonic()
    assert code_reward.score_code(respond(program), ADD_TESTS[:1], CONFIG) == -1.0
    assert time.monotonic() - started < CONFIG.code_test_timeout_s + 5


def test_timeout_kills_the_whole_process_group():
    # The program reports its pid, then hangs; after the timeout nothing of it survives.
    program = "import os, sys\nsys.stdout.write(str(os.getpid()))\nsys.stdout.flush()\nwhile True:\n    pass\n"
    result = run_program(program, "", CONFIG, timeout_s=1.0)
    assert result.status == "timeout"
    with pytest.raises(ProcessLookupError):
        os.kill(int(result.stdout), 0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_timeout_also_kills_children(tmp_path):
    # An interpreter wrapper leaves a child in the program's process group (the guard
    # forbids the program itself to fork); the group kill must take it down too.
    pid_file = tmp_path / "child.pid"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nsleep 60 &\necho $! > {pid_file}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    config = dataclasses.replace(CONFIG, python_executable=str(wrapper))
    result = run_program("while True:\n    pass\n", "", config, timeout_s=1.0)
    assert result.status == "timeout"
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_writes_outside_the_sandbox_dir_are_blocked(tmp_path):
    outside = tmp_path / "open"
    outside.mkdir()
    outside.chmod(0o777)  # writable by anyone: only the sandbox itself can stop the write
    canary = outside / "canary"
    attempts = [
        f"open({str(canary)!r}, 'w').write('x')",
        f"import pathlib; pathlib.Path({str(canary)!r}).write_text('x')",
        f"import os; os.close(os.open({str(canary)!r}, os.O_CREAT | os.O_WRONLY))",
        f"import os; os.chdir({str(outside)!r}); open('canary', 'w').write('x')",
        f"import os; os.symlink({str(outside)!r}, 'link'); open('link/canary', 'w').write('x')",
        f"import shutil; shutil.copy('main.py', {str(canary)!r})",
    ]
    for attempt in attempts:
        result = run_program(attempt + "\nprint('done')\n", "", CONFIG)
        assert result.status == "failed", (attempt, result)
        assert "blocked by the reward sandbox" in result.stderr, (attempt, result.stderr)
    assert not canary.exists()
    # Writing inside its own directory is fine.
    inside = run_program(
        "open('scratch.txt', 'w').write('x')\nprint(open('scratch.txt').read())\n", "", CONFIG
    )
    assert inside.status == "ok" and inside.stdout.strip() == "x"


def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
    try:
        result = run_program(program, "", CONFIG)
        assert result.status == "failed"
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()


def test_sandbox_capabilities_report():
    report = capabilities(CONFIG)
    assert set(report) == {"run_as_uid", "network", "nproc_limit_effective"}
    if os.geteuid() == 0:
        # As root, unshare(CLONE_NEWNET) is available on Linux unless seccomp forbids it.
        assert report["network"] in ("namespace", "audit")
    assert report["nproc_limit_effective"] == (report["run_as_uid"] != 0)


def test_reward_pool_scores_code_in_parallel():
    wrong = "print(0)\n"
    with RewardPool(CONFIG) as pool:
        rewards = pool.score_batch(
            [respond(ADD_PROGRAM), respond(wrong), respond(HOSTILE["infinite loop"])],
            [ADD_TESTS] * 3,
        )
        mixed = pool.score_batch(
            [respond(ADD_PROGRAM), "</think>\\boxed{4}"], [ADD_TESTS, "4"], kinds=["code", "math"]
        )
    assert rewards == [1.0, -1.0, -1.0]
    assert mixed == [1.0, 1.0]

"""The `gpu` extra pins what the code was written against."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _extras() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "EXTRAS":
            names = {"MODELOPT": "nvidia-modelopt"}
            return {
                ast.literal_eval(k): [
                    ast.literal_eval(e) if isinstance(e, ast.Constant) else names[e.id]
                    for e in v.elts
                ]
                for k, v in zip(node.value.keys, node.value.values)
            }
    raise AssertionError("no EXTRAS in setup.py")


def test_gpu_extra_pins_vllm_and_the_transformer_engine_range_of_megatron_core():
    gpu = _extras()["gpu"]
    assert "vllm==0.32.0" in gpu  # the weight-transfer / pause APIs the rollout code uses
    declared = [r for r in requires("megatron-core") if r.startswith("transformer-engine")]
    te_range = declared[0].split(";")[0].split("]", 1)[1].strip()  # e.g. "<2.12.0,>=2.9.0a0"
    ours = [r for r in gpu if r.startswith("transformer-engine")]
    assert len(ours) == 1 and set(ours[0].split("]", 1)[1].split(",")) == set(te_range.split(","))


def test_the_command_line_sets_the_omp_wait_policy_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: `megatron-rl` must set the
    passive policy before any import of torch, keep a value the user set, and hand it to the
    processes it starts."""
    code = (
        "import subprocess, sys\n"
        "import megatron_rl.cli\n"
        "assert 'torch' not in sys.modules, 'importing the CLI loads torch'\n"
        "megatron_rl.cli.main([])  # no command: prints the help\n"
        "probe = 'import os; print(os.environ.get(\"OMP_WAIT_POLICY\"))'\n"
        "subprocess.run([sys.executable, '-c', probe], check=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for user, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if user is None else {**env, "OMP_WAIT_POLICY": user}
        out = subprocess.run(
            [sys.executable, "-c", code], env=run_env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == expected

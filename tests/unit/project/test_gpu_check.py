"""tools/gpu_check.sh on the lent one-GPU machine (issue 27, 2.3): CUDA torch, transformers
and pytest there, no vLLM, Transformer Engine or pytest-xdist. What can be checked here: the
steps fit the script's time budget, its pytest call runs without xdist, the 8B memory
extrapolation uses recipes/scalerl_8b.yaml's layout, and the presets read the same under
transformers 4.x (the full run: `bash tools/gpu_check.sh --smoke` in a venv without xdist)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = (ROOT / "tools" / "gpu_check.sh").read_text()


def step_limits(script: str) -> dict[str, int]:
    """Seconds each step of the GPU run may take: ``step NAME N`` (the smoke and GPU branches
    share names: the larger counts) and any literal ``timeout N`` command."""
    limits: dict[str, int] = {}
    for name, seconds in re.findall(r"^\s*step (\w+) (\d+)", script, re.M):
        limits[name] = max(limits.get(name, 0), int(seconds))
    for i, seconds in enumerate(re.findall(r"\btimeout (\d+)", script)):
        limits[f"timeout{i}"] = int(seconds)
    return limits


def test_step_timeouts_fit_the_documented_budget():
    budget = int(re.search(r"^BUDGET_S=(\d+)", SCRIPT, re.M).group(1))
    documented = int(re.search(r"timeout_s (\d+)", SCRIPT).group(1))  # what the header says
    limits = step_limits(SCRIPT)
    assert budget == documented == 480
    assert {"gpu_check", "attention", "tests", "bench"} <= set(limits)
    assert sum(limits.values()) <= budget, limits


def test_pytest_step_runs_where_xdist_is_not_installed():
    # the check machine has no pytest-xdist: -p no:xdist makes this venv's look the same
    joined = SCRIPT.replace("\\\n", " ")
    args = shlex.split(
        re.search(r"-m pytest (.*tests/unit/models/test_gpu_paths\.py)", joined).group(1)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", *args, "--collect-only", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"test_gpu_paths\.py: \d+", proc.stdout), proc.stdout  # tests collected


def _llama3_8b_parameters() -> int:
    """Llama-3.1-8B's parameters by hand (untied embedding and head, GQA 32 q / 8 kv heads)."""
    h, ffn, vocab, layers, kv = 4096, 14336, 128256, 32, 8 * 128
    layer = h * h + 2 * kv * h + h * h + 3 * h * ffn + 2 * h  # q, k+v, o, gate/up/down, norms
    return 2 * vocab * h + layers * layer + h


def test_8b_extrapolation_uses_the_recipes_layout_and_shards_the_optimizer_over_dp():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "tools"))
    x = gpu_check.recipe_extrapolation(None, None)
    assert (x["tensor"], x["dp"]) == (2, 8)  # scalerl_8b: TP 2, 16 trainer GPUs
    p = _llama3_8b_parameters()
    assert abs(p - 8_030_261_248) < 1e6  # the published count
    # bf16 weights + fp32 grads split by TP; fp32 main params + 2 Adam moments also by DP
    expected = p * (2 + 4) / 2 + p * 12 / (2 * 8)
    assert x["planned_state"] == pytest.approx(expected, rel=0.01)
    # what the slice measured scales the plan: twice the planned slice states, twice the states
    doubled = gpu_check.recipe_extrapolation(2 * x["slice_state"], x["slice_acts"])
    assert (doubled["state_ratio"], doubled["act_ratio"]) == (2.0, 1.0)
    assert doubled["scaled_total"] - x["scaled_total"] == pytest.approx(x["planned_state"], abs=2)
    tp4 = gpu_check.recipe_extrapolation(None, None, overrides=("parallel.tensor=4",))
    assert (tp4["tensor"], tp4["dp"]) == (4, 4)
    assert tp4["planned_state"] == pytest.approx(p * 6 / 4 + p * 12 / 16, rel=0.01)


def test_presets_give_transformers_4_its_own_rope_fields(monkeypatch):
    from megatron_rl.models import presets

    transformers = presets.transformers  # the module presets reads (another test may reload it)
    from megatron_rl.models.provider import rope_parameters

    monkeypatch.setattr(transformers, "__version__", "4.57.6")
    llama3 = presets._for_installed_transformers(dict(presets.PRESETS["llama3-8b"]))
    assert "rope_parameters" not in llama3 and llama3["rope_theta"] == 500000.0
    assert llama3["rope_scaling"]["rope_type"] == "llama3"
    assert llama3["rope_scaling"]["factor"] == 8.0 and "rope_theta" not in llama3["rope_scaling"]
    tiny = presets._for_installed_transformers(dict(presets.PRESETS["tiny-llama"]))
    assert tiny["rope_theta"] == 31337.0 and "rope_scaling" not in tiny
    # a 4.x config carries rope_theta / rope_scaling; the provider reads either form
    old = SimpleNamespace(rope_theta=31337.0, rope_scaling=None)
    assert rope_parameters(old) == {"rope_theta": 31337.0}
    monkeypatch.setattr(transformers, "__version__", "5.19.0")
    assert (
        presets._for_installed_transformers(dict(presets.PRESETS["tiny-llama"]))
        == (presets.PRESETS["tiny-llama"])
    )
    assert rope_parameters(presets.preset_hf_config("tiny-llama"))["rope_theta"] == 31337.0

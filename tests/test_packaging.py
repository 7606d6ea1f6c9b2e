"""The `gpu` extra pins what the code was written against."""

from __future__ import annotations

import ast
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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

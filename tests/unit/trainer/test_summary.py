"""The start and end summaries of a run (megatron_rl/trainer/summary.py); --quiet: test_console.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

from megatron_rl.config import load_run_config
from megatron_rl.data.config import DataConfig, ResolvedSource
from megatron_rl.data.prompts import Prompt, PromptData
from megatron_rl.trainer import summary

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, hours: dict | None = None) -> SimpleNamespace:
    sources = [
        ResolvedSource("arith", "math", 2.0, DataConfig(source="synthetic")),
        ResolvedSource("", "code", 1.0, DataConfig(source="synthetic_code")),
    ]
    kinds = ["math"] * 5 + ["code"] * 3
    prompts = [
        Prompt(prompt_id=i, problem="p", answer="1", source=0 if k == "math" else 1, domain=k)
        for i, k in enumerate(kinds)
    ]
    data = PromptData(prompts, train_ids=[0, 1, 2, 5, 6], val_ids=[3, 4, 7], sources=sources)
    clock = SimpleNamespace(summary=lambda: hours or {"gpu_hours": 0.5, "total_gpu_hours": 0.75})
    return SimpleNamespace(run_dir=tmp_path, hf_dir=tmp_path / "hf_init", data=data, clock=clock)


def test_start_block_names_layout_model_data_budget_and_outputs(tmp_path):
    config = load_run_config(
        ROOT / "recipes" / "tiny_cpu.yaml",
        [
            "parallel.tensor=2",
            "rollout.engines=3",
            "rollout.placement=subprocess",
            "cluster.gpus_per_node=7",
            "cluster.trainer_gpus=4",
            "cluster.generator_gpus=3",
            "training.max_steps=40",
        ],  # fmt: skip
        check_model=False,
    )
    text = summary.start_block(config, _run(tmp_path), step=10, world=4)
    assert "4 trainer ranks: TP 2, PP 1, EP 1, CP 1, DP 2" in text
    assert "3 engines x TP 1, placement subprocess" in text
    # Resumed at step 10: the weights are the checkpoint's, not a random initialisation.
    assert f"weights from the step-10 checkpoint in {tmp_path}/checkpoints/" in text
    assert "random initialisation" not in text
    fresh = summary.start_block(config, _run(tmp_path), step=0, world=4)
    assert f"random initialisation of preset tiny-llama, written to {tmp_path}/hf_init" in fresh
    assert "arith (math, synthetic, weight 2): 3 train, 2 validation prompts" in text
    assert "code (code, synthetic_code, weight 1): 2 train, 1 validation prompts" in text
    assert "budget: 40 steps, from step 10 (resumed)" in text
    assert f"{tmp_path}/metrics.jsonl" in text and f"{tmp_path}/checkpoints/" in text


def test_end_block_reads_the_validations_and_lists_the_run_directory(tmp_path):
    config = load_run_config(ROOT / "recipes" / "tiny_cpu.yaml", check_model=False)
    records = [
        {"step": 0, "gpu_hours": 0.0, "val_pass_rate": 0.2},
        {"step": 1, "gpu_hours": 0.1, "reward_mean": 0.0},
        {"step": 3, "gpu_hours": 0.2, "val_pass_rate": 0.45},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "checkpoints").mkdir()
    text = summary.end_block(config, _run(tmp_path), first_step=1, step=3, outcome="finished")
    assert text.startswith(f"run {config.name} finished:")
    assert "steps: 2 this job, 3 of 120 in all" in text
    assert "validation pass rate: 0.200 first, 0.450 last (2 validations)" in text
    assert "GPU-hours: 0.5 training, 0.75 total" in text
    assert f"run directory {tmp_path}: checkpoints/, metrics.jsonl" in text
    assert f"megatron-rl fit {tmp_path}/metrics.jsonl" in text
    assert f"megatron-rl train {tmp_path}/config.yaml --run-dir {tmp_path}" in text


def test_end_summary_never_raises(tmp_path, caplog):
    config = load_run_config(ROOT / "recipes" / "tiny_cpu.yaml", check_model=False)
    broken = SimpleNamespace(run_dir=tmp_path, clock=None)  # no clock: the summary fails
    with caplog.at_level(logging.INFO, logger="megatron_rl.trainer.summary"):
        summary.log_end(config, broken, 0, 1, "failed", main=True)
    assert "no end summary" in caplog.text


def test_the_resume_command_of_the_summary_is_accepted(tmp_path):
    """The end summary's resume loads RUN_DIR/config.yaml as the recipe: the run directory's
    change check finds nothing changed (with a recipe's overrides and its own name)."""
    from megatron_rl.config.schema import to_yaml
    from megatron_rl.trainer.rundir import check_changes

    overrides = ["optimizer.lr=3e-5", "off_policy.mode=ppo", "data.val_size=16"]
    config = load_run_config(ROOT / "recipes" / "tiny_cpu.yaml", overrides, check_model=False)
    (tmp_path / "config.yaml").write_text(to_yaml(config))  # as rundir.claim writes it
    again = load_run_config(tmp_path / "config.yaml", check_model=False)
    assert again.name == "tiny_cpu"
    assert check_changes(tmp_path / "config.yaml", to_yaml(again), allow_changes=False) == {}


def test_the_start_block_says_the_step_a_resume_goes_on_from(tmp_path):
    """The start block is logged before the checkpoint is loaded (the console's first line):
    its step is the newest intact checkpoint's, the one the resume then loads."""
    latest = {"path": tmp_path / "checkpoints" / "step_00000040"}
    run = SimpleNamespace(checkpoints=SimpleNamespace(latest=lambda: latest["path"]))
    assert summary.resume_step(run) == 40
    latest["path"] = None
    assert summary.resume_step(run) == 0

"""Production presets refuse to start from random weights (issue 27, 2.2): without
``model.hf_path`` rank 0 would write a random fp32 HF model of the preset (Scout: ~431 GB) and
train it with the character tokenizer. Tiny presets keep starting from a local random init."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.config.checks import check_start_weights
from megatron_rl.models.presets import PRESETS

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TINY = {"tiny_cpu", "tiny_cpu_ppo", "tiny_cpu_math_code", "tiny_cpu_tool"}


def _checkpoint(tmp_path: Path, preset: str) -> Path:
    """An HF directory holding only the preset's config.json (all the recipe loader reads)."""
    path = tmp_path / preset
    path.mkdir()
    (path / "config.json").write_text(json.dumps(PRESETS[preset]))
    return path


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_production_recipe_refuses_to_start_without_a_checkpoint(path):
    config = load_run_config(path)  # every shipped recipe still loads
    if path.stem in TINY:
        check_start_weights(config)  # the embedded default makes its model locally
        return
    with pytest.raises(ConfigError) as err:
        check_start_weights(config)
    message = str(err.value)
    assert "recipe key 'model.hf_path'" in message and "model.allow_random_init=true" in message
    assert config.model.preset in message
    config.model.allow_random_init = True  # on purpose: allowed
    check_start_weights(config)


def test_the_message_says_how_big_the_random_model_would_be():
    config = load_run_config(ROOT / "recipes/scalerl_scout.yaml")
    with pytest.raises(ConfigError, match=r"~431 GB fp32"):  # 107.8e9 parameters x 4 bytes
        check_start_weights(config)


def test_a_checkpoint_lets_a_production_recipe_start(tmp_path):
    hf = _checkpoint(tmp_path, "llama3-8b")
    config = load_run_config(ROOT / "recipes/scalerl_8b.yaml", [f"model.hf_path={hf}"])
    check_start_weights(config)


def test_train_refuses_before_any_work_and_dry_run_only_warns(tmp_path, capsys, monkeypatch):
    import megatron_rl.trainer.loop as loop

    started = []
    monkeypatch.setattr(loop, "train", lambda config, run_dir, *_: started.append(run_dir) or 0)
    recipe = str(ROOT / "recipes/scalerl_scout.yaml")
    run_dir = tmp_path / "run"
    code = cli_main(["train", recipe, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and not started and not run_dir.exists()
    assert "error: recipe key 'model.hf_path'" in err and "allow_random_init" in err
    code = cli_main(["train", recipe, "--dry-run"])
    out = capsys.readouterr()
    assert code == 0 and "warning: recipe key 'model.hf_path'" in out.err
    assert "preset: llama4-scout" in out.out
    monkeypatch.setenv("WORLD_SIZE", "32")  # its 32 trainer ranks' launcher
    code = cli_main(["train", recipe, "model.allow_random_init=true", "--run-dir", str(run_dir)])
    assert code == 0 and started == [run_dir]


def test_build_run_refuses_on_every_rank_before_distributed_init(tmp_path, monkeypatch):
    # Refused on rank 0 alone (where the random model is written), the other ranks would wait
    # on the barrier: build_run checks before initialising anything.
    import megatron_rl.platform.parallel as parallel
    from megatron_rl.trainer.setup import build_run

    class Started(Exception):
        pass

    def init_distributed(*args, **kwargs):
        raise Started

    monkeypatch.setattr(parallel, "init_distributed", init_distributed)
    config = load_run_config(ROOT / "recipes/scalerl_8b.yaml")
    with pytest.raises(ConfigError, match="model.hf_path"):
        build_run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def _fake_sbatch(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch.args\necho 7\n')
    sbatch.chmod(0o755)
    return bin_dir


def test_launch_refuses_to_submit_without_a_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_sbatch(tmp_path)}:{os.environ['PATH']}")
    recipe = str(ROOT / "recipes/scalerl_scout.yaml")
    code = cli_main(["launch", recipe, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "model.hf_path" in err and not (tmp_path / "sbatch.args").exists()
    # a dry run prints the script (which asks for $HF_PATH) and warns
    code = cli_main(["launch", recipe, "--dry-run"])
    out = capsys.readouterr()
    assert code == 0 and "warning: recipe key 'model.hf_path'" in out.err
    assert '"model.hf_path=$HF_PATH"' in out.out
    # with a checkpoint it submits, and the script carries the recipe's own hf_path
    hf = _checkpoint(tmp_path, "llama4-scout")
    code = cli_main(["launch", recipe, f"model.hf_path={hf}", "--run-dir", str(tmp_path / "r")])
    capsys.readouterr()
    script = (tmp_path / "r" / "job.sbatch").read_text()
    assert code == 0 and (tmp_path / "sbatch.args").exists()
    assert "HF_PATH" not in script and f"model.hf_path={hf}" in script


@pytest.mark.parametrize("script", ["scalerl_8b.sbatch", "scalerl_scout.sbatch"])
def test_checked_in_script_ends_at_once_without_hf_path(tmp_path, script):
    # Stand-ins for the Slurm commands: any call means the job got past the check.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol", "squeue", "scancel"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho {name} >> {tmp_path}/calls\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "HF_PATH"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="n1")
    env.update(SLURM_JOB_NAME="x")
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "model.hf_path" in proc.stderr
    assert not (tmp_path / "calls").exists()

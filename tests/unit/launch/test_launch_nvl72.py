"""The sbatch script on GB200 NVL72 (issue 27, 2.6): NCCL's MNNVL and NVLS left to NCCL unless
the recipe sets them, NVLS off on the engines, and a ``--segment`` request that keeps the
trainer's nodes in one NVLink domain (rack)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.launch.render import LaunchOptions, render_job_script
from megatron_rl.rollout.engine.nccl_env import ENGINE_NVLS_ENV

ROOT = Path(__file__).resolve().parents[3]
B8 = str(ROOT / "recipes/scalerl_8b.yaml")
SCOUT = str(ROOT / "recipes/scalerl_scout.yaml")
TINY = str(ROOT / "recipes/tiny_cpu.yaml")
NCCL = ("NCCL_MNNVL_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE")


def render(recipe: str, *overrides: str, device: str = "gpu") -> str:
    config = load_run_config(recipe, overrides)
    return render_job_script(config, recipe, overrides, "/runs/x", LaunchOptions(device))


def segment(script: str) -> str | None:
    found = re.findall(r"^#SBATCH --segment=(\d+)$", script, re.M)
    return found[0] if found else None


def job_env(script: str) -> dict[str, str | None]:
    """The NCCL variables the batch shell exports (run by bash, none set beforehand)."""
    block = script[script.index("# -- GPUs and NCCL") : script.index("export PYTHONUNBUFFERED")]
    probe = block + "\n" + "\n".join(f'echo "{n}=${{{n}-unset}}"' for n in NCCL)
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True).stdout
    values = dict(line.split("=", 1) for line in out.split())
    return {k: None if v == "unset" else v for k, v in values.items()}


def generator_args(script: str) -> str:
    return re.search(r"GENERATOR_GPU_ARGS=\(([^)]*)\)", script).group(1)


def step_env(script: str, role: str) -> dict[str, str]:
    """The environment a step's tasks start with (submitted with none set beforehand): the
    batch shell's exports, run by bash, then the step's ``srun --export=ALL,K=V,...``."""
    start = script.index("TRAINER_TASKS=")
    block = script[start : script.index("export PYTHONUNBUFFERED")]
    probe = block + "\nenv -0"
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", probe], env=env, capture_output=True, text=True).stdout
    values = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    args = re.search(rf"{role.upper()}_GPU_ARGS=\(([^)]*)\)", script).group(1)
    for arg in args.split():
        if arg.startswith("--export=ALL"):
            values.update(pair.split("=", 1) for pair in arg.split(",")[1:])
    return values


def nccl_vars(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("NCCL_")}


@pytest.mark.parametrize(
    "recipe, overrides",
    [
        (B8, ()),
        (SCOUT, ()),
        (SCOUT, ("rollout.weight_transport=nccl",)),
        (SCOUT, ("cluster.nccl_nvls=true",)),
        (SCOUT, ("cluster.nccl_mnnvl=true", "cluster.nccl_nvls=false")),
        (SCOUT, ("cluster.engine_nccl_nvls=true",)),
    ],
)
def test_trainer_and_engines_share_one_nccl_environment(recipe, overrides):
    """The trainer's weight sender and the engines' workers are ranks of one NCCL
    communicator: NCCL never reconciles NCCL_* settings across ranks (vLLM 0.32 warns a
    mismatch can hang), so both steps start with the same NCCL_* variables; the engines' own
    NVLS goes as a variable NCCL does not read (a vLLM pin for their own communicators), and
    Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 reaches the trainer only."""
    script = render(recipe, *overrides)
    trainer, engines = step_env(script, "trainer"), step_env(script, "generator")
    assert nccl_vars(trainer) == nccl_vars(engines)
    assert nccl_vars(trainer)["NCCL_CUMEM_ENABLE"] == "1"
    assert trainer["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in engines
    engine_nvls = "1" if "cluster.engine_nccl_nvls=true" in overrides else "0"
    assert engines[ENGINE_NVLS_ENV] == engine_nvls and ENGINE_NVLS_ENV not in trainer


@pytest.mark.parametrize("recipe", [B8, SCOUT])
def test_mnnvl_and_nvls_are_left_to_nccl_and_engines_run_without_nvls(recipe):
    script = render(recipe)
    # NCCL's auto-detect for MNNVL (forced on, NCCL fails at init without an IMEX channel)
    env = job_env(script)
    assert env["NCCL_MNNVL_ENABLE"] is None and env["NCCL_NVLS_ENABLE"] is None
    assert env["NCCL_CUMEM_ENABLE"] == "1"
    assert f"--export=ALL,{ENGINE_NVLS_ENV}=0" in generator_args(script)
    assert "NCCL_NVLS" not in re.search(r"TRAINER_GPU_ARGS=\(([^)]*)\)", script).group(1)


def test_the_recipe_can_set_mnnvl_and_nvls():
    script = render(
        SCOUT, "cluster.nccl_mnnvl=true", "cluster.nccl_nvls=false", "cluster.engine_nccl_nvls=true"
    )
    env = job_env(script)
    assert (env["NCCL_MNNVL_ENABLE"], env["NCCL_NVLS_ENABLE"]) == ("1", "0")
    assert f"--export=ALL,{ENGINE_NVLS_ENV}=1" in generator_args(script)


@pytest.mark.parametrize(
    "recipe, nodes, trainer_nodes, expected",
    [
        # the smallest divisor of the job's nodes that holds the trainer's nodes and fits one
        # 72-GPU rack (18 nodes of 4 GB200): Scout 32 nodes, trainer 8 -> 8; 8B 20, 4 -> 4
        (SCOUT, 32, 8, "8"),
        (B8, 20, 4, "4"),
    ],
)
def test_segment_keeps_the_trainer_in_one_nvlink_domain(recipe, nodes, trainer_nodes, expected):
    script = render(recipe)
    assert segment(script) == expected
    size = int(expected)
    assert nodes % size == 0 and trainer_nodes <= size <= 72 // 4
    assert f"--segment={expected} keeps them there" in script


def test_segment_is_requested_only_where_it_means_something():
    assert segment(render(TINY, device="cpu")) is None
    assert segment(render(SCOUT, device="cpu")) is None  # CPU task slots: no NVLink
    assert segment(render(SCOUT, "cluster.segment=0")) is None  # Slurm < 24.11: off
    h100 = render(B8, "cluster.nvlink_domain_gpus=0")  # no NVLink between nodes
    assert segment(h100) is None and "NVLink domain" not in h100.split("set -uo")[0]
    assert segment(render(SCOUT, "cluster.segment=16")) == "16"
    # a trainer larger than a rack: no segment can hold it, the note says what to do
    big = render(SCOUT, "cluster.nvlink_domain_gpus=16")
    assert segment(big) is None and "set cluster.segment" in big


@pytest.mark.parametrize(
    "value, phrase",
    [("3", "does not divide cluster.nodes 20"), ("2", "trainer's 4 nodes"), ("20", "exceed one")],
)
def test_a_segment_that_cannot_hold_the_trainer_fails_naming_the_key(capsys, value, phrase):
    code = cli_main(["launch", B8, f"cluster.segment={value}", "--dry-run"])
    err = capsys.readouterr().err
    assert code == 2 and "recipe key 'cluster.segment'" in err and phrase in err, err
    with pytest.raises(ConfigError, match="cluster.segment"):
        render(B8, f"cluster.segment={value}")

"""`megatron-rl launch`: layout, rendered sbatch scripts, task wrappers, submission (no Slurm
needed; the `slurm`-marked tests in test_slurm.py run the scripts on a real cluster)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.cli import main as cli_main
from megatron_rl.config import ConfigError, load_run_config
from megatron_rl.launch.layout import plan_job
from megatron_rl.launch.render import LaunchOptions, render_job_script
from megatron_rl.launch.template import JOB_TEMPLATE

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "recipes" / "tiny_cpu.yaml")


def launch(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["launch", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def directives(script: str) -> dict[str, str]:
    found = re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.M)
    return {key: value for key, value in found}


def variables(script: str) -> dict[str, str]:
    """NAME=value assignments of the script's set-up block (``A=1; B=(x y)``)."""
    return dict(re.findall(r"(?:^|; |export )([A-Z_]+)=(\([^)]*\)|[^;\s]*)", script, re.M))


def render(recipe: str, *overrides: str, **options) -> str:
    config = load_run_config(recipe, overrides)
    return render_job_script(config, recipe, overrides, "/runs/x", LaunchOptions(**options))


def bash_syntax_ok(script: str) -> bool:
    return subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_8b_dry_run_is_20_nodes_of_4_gpus_with_16_trainer_and_64_generator_gpus(capsys):
    code, script, _ = launch(capsys, str(ROOT / "recipes/scalerl_8b.yaml"), "--dry-run")
    assert code == 0
    d, v = directives(script), variables(script)
    # docs/paper.md section 3: 80 GB200 GPUs = 20 nodes x 4; 16 train, 64 generate (1 GPU each)
    assert (d["nodes"], d["gpus-per-node"]) == ("20", "4")
    assert (v["TRAINER_TASKS"], v["TRAINER_NODES"], v["TRAINER_TASKS_PER_NODE"]) == ("16", "4", "4")
    assert (v["GENERATOR_TASKS"], v["GENERATOR_NODES"], v["ENGINE_GPUS"]) == ("64", "16", "1")
    assert v["GENERATOR_FIRST_NODE"] == "4"  # generators after the trainer's nodes
    assert d["time"] == "04:00:00" and "requeue" in d and d["open-mode"] == "append"
    assert d["signal"] == "B:USR1@300"  # signal_minutes_before_end 5
    for name in ("NCCL_CUMEM_ENABLE", "NVIDIA_IMEX_CHANNELS"):
        assert f"export {name}=" in script
    # MNNVL and NVLS are NCCL's to decide (tests/unit/launch/test_launch_nvl72.py)
    assert "export NCCL_MNNVL_ENABLE" not in script and "export NCCL_NVLS_ENABLE" not in script
    assert "rollout.placement=remote" in v["TRAIN_ARGS"]
    assert "--kill-on-bad-exit=1" in script and "--wait=" in script
    assert bash_syntax_ok(script)


def test_scout_layout_puts_one_4_gpu_engine_per_generator_node():
    script = render(str(ROOT / "recipes/scalerl_scout.yaml"))
    d, v = directives(script), variables(script)
    assert (d["nodes"], d["gpus-per-node"]) == ("32", "4")
    assert (v["TRAINER_TASKS"], v["TRAINER_NODES"]) == ("32", "8")
    assert (v["GENERATOR_TASKS"], v["GENERATOR_NODES"], v["ENGINE_GPUS"]) == ("24", "24", "4")
    assert v["GENERATOR_TASKS_PER_NODE"] == "1"


@pytest.mark.parametrize(
    "overrides, key, phrase",
    [
        (["cluster.trainer_gpus=12"], "cluster.trainer_gpus", "must equal nodes"),
        (
            [
                "cluster.nodes=3",
                "cluster.trainer_gpus=6",
                "cluster.generator_gpus=6",
                "rollout.engines=6",
            ],
            "cluster.trainer_gpus",
            "not a multiple of cluster.gpus_per_node 4",
        ),
        (["rollout.tensor_parallel=8", "rollout.engines=8"], "rollout.tensor_parallel", "one node"),
        (["rollout.engines=32"], "rollout.engines", "set rollout.engines to 64"),
        (["cluster.time=soon"], "cluster.time", "Slurm time limit"),
    ],
)
def test_cluster_section_that_does_not_add_up_fails_naming_the_key(capsys, overrides, key, phrase):
    code, out, err = launch(capsys, str(ROOT / "recipes/scalerl_8b.yaml"), *overrides, "--dry-run")
    assert code == 2 and out == ""
    assert f"'{key}'" in err and phrase in err, err


def test_optional_settings_render_only_when_set():
    plain = render(TINY, device="cpu")
    d = directives(plain)
    assert not {"partition", "account", "gpus-per-node"} & set(d)
    assert "NCCL_MNNVL_ENABLE" not in plain and "--container-image" not in plain
    v = variables(plain)
    assert (v["TRAINER_GPU_ARGS"], v["GENERATOR_GPU_ARGS"], v["CONTAINER_ARGS"]) == ("()",) * 3
    assert (v["TRAINER_TASKS"], v["GENERATOR_TASKS"]) == ("1", "1")
    assert d["ntasks-per-node"] == "2" and d["signal"] == "B:USR1@60"

    full = render(
        TINY,
        "cluster.partition=gb200",
        "cluster.account=rl",
        "cluster.container_image=nvcr.io#nvidia/pytorch:25.01-py3",
        "cluster.container_mounts=[/lustre:/lustre,/home/me:/workspace]",
        "cluster.requeue=false",
        "cluster.signal_minutes_before_end=0",
        cpus_per_task=3,
    )
    d, v = directives(full), variables(full)
    assert (d["partition"], d["account"], d["cpus-per-task"]) == ("gb200", "rl", "3")
    assert "requeue" not in d and "signal" not in d and v["REQUEUE"] == "0"
    assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in full
    assert "--container-mounts=/lustre:/lustre,/home/me:/workspace" in full
    assert bash_syntax_ok(plain) and bash_syntax_ok(full)


def test_tiny_recipe_shares_its_one_node_between_the_roles():
    layout = plan_job(load_run_config(TINY), "cpu")
    assert layout.shared_node
    assert (layout.trainer.tasks, layout.generator.tasks) == (1, 1)
    assert layout.trainer.tasks_sharing_node == layout.generator.tasks_sharing_node == 2
    with pytest.raises(ValueError, match="device"):
        plan_job(load_run_config(TINY), "tpu")


def _task_script(name: str) -> str:
    return re.search(rf"^{name}='(.*?)'$", JOB_TEMPLATE, re.M | re.S).group(1)


SLURM_ENV = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}


def test_trainer_task_gets_torchrun_variables_from_slurm():
    env = {**os.environ, **SLURM_ENV, "MASTER_ADDR": "node7", "MASTER_PORT": "20042"}
    show = "import os; print(*(os.environ[k] for k in ('RANK','WORLD_SIZE','LOCAL_RANK','MASTER_ADDR')))"
    proc = subprocess.run(
        ["bash", "-c", _task_script("TRAINER_TASK"), "trainer", sys.executable, "-c", show],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "5 16 1 node7" in lines
    assert lines[0].startswith("megatron-rl task: role=trainer rank=5 world_size=16 local_rank=1")
    assert lines[-1] == "megatron-rl task: role=trainer rank=5 exited with status 0"


CHILD = """
import signal, sys, time
time.sleep(1.5)  # still starting up: SIGUSR1 is ignored until the handler below
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
deadline = time.time() + 20
while not got and time.time() < deadline:
    time.sleep(0.05)
print("trainer got", got, flush=True)
sys.exit(7 if got == [signal.SIGUSR1] else 1)
"""


def test_trainer_task_relays_the_stop_request_as_one_sigusr1_once_the_trainer_handles_it():
    env = {**os.environ, **SLURM_ENV, "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    proc = subprocess.Popen(
        ["bash", "-c", _task_script("TRAINER_TASK"), "trainer", sys.executable, "-c", CHILD],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)
    proc.send_signal(signal.SIGWINCH)  # what the batch shell sends the trainer step
    out, _ = proc.communicate(timeout=60)
    # the early request was neither lost nor fatal, and the trainer got exactly one SIGUSR1
    assert f"trainer got [{int(signal.SIGUSR1)}]" in out
    assert proc.returncode == 7  # the trainer's own status is the task's
    assert out.count("SIGUSR1 sent") == 1


def test_generator_task_takes_its_engines_gpus_and_passes_its_index():
    env = {**os.environ, **SLURM_ENV, "CUDA_VISIBLE_DEVICES": "4,5,6,7", "ENGINE_GPUS": "2"}
    show = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES'], sys.argv[1:])"
    proc = subprocess.run(
        ["bash", "-c", _task_script("GENERATOR_TASK"), "generator", sys.executable, "-c", show],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    # local task 1 with 2 GPUs per engine: the second pair of the step's GPUs
    assert proc.stdout.splitlines()[-1] == "6,7 ['--engine', '5']"
    assert "role=generator engine=5" in proc.stdout


def _fake_sbatch(tmp_path: Path, body: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/sbatch.args\n{body}\n')
    sbatch.chmod(0o755)
    return bin_dir


def test_launch_writes_the_script_into_the_run_dir_and_submits_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_sbatch(tmp_path, 'echo 4242')}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    code, out, err = launch(
        capsys, TINY, "training.max_steps=3", "--device", "cpu", "--run-dir", str(run_dir)
    )
    assert code == 0, err
    script = run_dir / "job.sbatch"
    assert (tmp_path / "sbatch.args").read_text().split() == ["--parsable", str(script)]
    assert (run_dir / "logs").is_dir() and "submitted job 4242" in out
    config = load_run_config(TINY, ["training.max_steps=3"])
    options = LaunchOptions("cpu", sys.executable, os.getcwd())
    assert script.read_text() == render_job_script(
        config, TINY, ["training.max_steps=3"], str(run_dir), options
    )
    assert variables(script.read_text())["MAX_STEPS"] == "3"


def test_launch_reports_sbatch_failures_and_absence(tmp_path, capsys, monkeypatch):
    bin_dir = _fake_sbatch(tmp_path, "echo 'sbatch: error: invalid partition' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    code, _, err = launch(capsys, TINY, "--device", "cpu", "--run-dir", str(tmp_path / "r"))
    assert code == 1 and "invalid partition" in err
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    code, _, err = launch(capsys, TINY, "--device", "cpu", "--run-dir", str(tmp_path / "r"))
    assert code == 1 and "sbatch not found" in err


def test_config_error_type_is_shared_with_the_recipe_loader():
    # launch reports layout problems as the recipe loader's ConfigError (exit status 2)
    config = load_run_config(TINY)
    config.rollout.engines = 2
    config.cluster.generator_gpus = 1
    with pytest.raises(ConfigError, match="rollout.engines"):
        plan_job(config)

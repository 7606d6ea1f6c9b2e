"""Run-config schema: strict loading, dotted key paths in errors, cross-section checks,
overrides, YAML round trip, and the `megatron-rl train --dry-run` front end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import (
    ConfigError,
    OptimizerConfig,
    RunConfig,
    diff_keys,
    load_run_config,
    run_config_from_dict,
    to_yaml,
)

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
TINY = RECIPES / "tiny_cpu.yaml"


def write_recipe(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def tiny_child(tmp_path: Path, body: str) -> Path:
    """A recipe extending tiny_cpu.yaml with ``body`` (YAML)."""
    return write_recipe(tmp_path, f"base: {TINY}\n{body}")


def error_of(path: Path, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_run_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["optimizer.lrr=1"], "'optimizer.lrr'"),  # unknown key
        (["batch.prompts_per_step=many"], "'batch.prompts_per_step'"),  # wrong type
        (["algorithm.zero_variance_filter=3"], "'algorithm.zero_variance_filter'"),
        (["off_policy.mode=async"], "'off_policy.mode'"),  # not a choice
        (["off_policy.max_lag=0"], "'off_policy.max_lag'"),  # k < 1
        (["off_policy.k=0"], "'off_policy.k'"),
        (["validation.every_steps=0"], "'validation.every_steps'"),
        (["parallel.tensor=0"], "'parallel.tensor'"),  # a component's validate()
        (["data.synthetic.max_digits=0"], "'data.synthetic.max_digits'"),  # nested component
        (["data.dynamic_sampling_max_rounds=0"], "'data.dynamic_sampling_max_rounds'"),
        (["data.dynamic_sampling=1"], "'data.dynamic_sampling'"),
        (
            ["rollout.interruption.thinking_budget=[30,60]"],
            "'rollout.interruption.thinking_budget'",
        ),
        (["rollout.max_model_len=40"], "'rollout.max_model_len'"),  # 16 + 48 > 40
        (["rollout.expert_parallel=true"], "'rollout.expert_parallel'"),  # tensor_parallel 1
        (
            ["rollout.expert_parallel=true", "rollout.tensor_parallel=2"]
            + ["cluster.gpus_per_node=3", "cluster.generator_gpus=2"],
            "'rollout.expert_parallel'",  # a dense model
        ),
        (["batch.micro_batch_tokens=32"], "'batch.micro_batch_tokens'"),
        (["batch.micro_batch_size=4"], "'batch.micro_batch_size'"),  # both micro-batch kinds
        (["batch.samples_per_prompt=1"], "'batch.samples_per_prompt'"),
        (["rollout.samples_per_prompt=4"], "'rollout.samples_per_prompt'"),  # != batch's 8
        (["cluster.nodes=2"], "'cluster.trainer_gpus'"),  # 1 + 1 != 2 x 2
        (["cluster.time=12:30:00"], "'cluster.time'"),  # unquoted: YAML reads base 60
        (["data.val_size=0"], "'validation.enabled'"),
        (["validation.num_prompts=65"], "'validation.num_prompts'"),
        (["warm_start.steps=-1"], "'warm_start.steps'"),
        (["training.logprob_probe_every=-1"], "'training.logprob_probe_every'"),
        (["training.logprob_probe_samples=0"], "'training.logprob_probe_samples'"),
        (["training.logprob_probe_max_tokens=49"], "'training.logprob_probe_max_tokens'"),
        (["data.solution_field="], "'warm_start.steps'"),  # warm start without solutions
        (["name=a/b"], "'name'"),
    ],
)
def test_malformed_recipe_names_the_key(overrides, key):
    message = error_of(TINY, overrides)
    assert key in message, message


def test_model_shape_checks_name_the_parallel_key(tmp_path):
    # tiny-llama: 4 heads, 2 KV heads, 2 layers, vocab 128, dense.
    cluster = ["cluster.gpus_per_node=4", "cluster.generator_gpus=1"]
    msg = error_of(TINY, ["parallel.tensor=3", "cluster.trainer_gpus=3", *cluster])
    assert "'parallel.tensor'" in msg and "4 attention heads" in msg and "tiny-llama" in msg
    msg = error_of(
        TINY,
        [
            "parallel.tensor=4",
            "cluster.trainer_gpus=4",
            "cluster.nodes=2",
            "cluster.gpus_per_node=4",
            "cluster.generator_gpus=4",
        ],
    )
    assert "'parallel.tensor'" in msg and "2 key/value heads" in msg
    msg = error_of(
        TINY,
        [
            "parallel.expert=2",
            "cluster.gpus_per_node=4",
            "cluster.trainer_gpus=2",
            "cluster.generator_gpus=2",
        ],
    )
    assert "'parallel.expert'" in msg and "dense" in msg
    msg = error_of(TINY, ["parallel.pipeline=3", "cluster.trainer_gpus=3", *cluster])
    assert "'parallel.pipeline'" in msg and "2 layers" in msg
    # Longest sequence beyond the preset's 512 positions.
    msg = error_of(TINY, ["rollout.max_tokens=600", "rollout.max_model_len=null"])
    assert "'rollout.max_tokens'" in msg and "512 positions" in msg
    msg = error_of(TINY, ["model.preset=nope"])
    assert "'model.preset'" in msg and "tiny-llama" in msg
    # The MoE preset accepts expert parallelism over its 4 experts, not over 3.
    ok = ["model.preset=tiny-llama4", "cluster.gpus_per_node=4"]
    cfg = load_run_config(
        TINY, [*ok, "parallel.expert=2", "cluster.trainer_gpus=2", "cluster.generator_gpus=2"]
    )
    assert cfg.parallel.expert == 2
    msg = error_of(
        TINY, [*ok, "parallel.expert=3", "cluster.trainer_gpus=3", "cluster.generator_gpus=1"]
    )
    assert "'parallel.expert'" in msg and "4 experts" in msg
    # megatron trains MoE layers under TP only with sequence parallelism.
    tp2 = [*ok, "parallel.tensor=2", "cluster.trainer_gpus=2", "cluster.generator_gpus=2"]
    msg = error_of(TINY, tp2)
    assert "'parallel.sequence_parallel'" in msg
    assert load_run_config(TINY, [*tp2, "parallel.sequence_parallel=true"]).parallel.tensor == 2


def test_routing_replay_needs_an_moe_model_and_no_recompute_under_a_pipeline():
    msg = error_of(TINY, ["algorithm.routing_replay=true"])
    assert "'algorithm.routing_replay'" in msg and "dense" in msg
    moe = ["model.preset=tiny-llama4", "algorithm.routing_replay=true"]
    assert load_run_config(TINY, moe).algorithm.routing_replay
    pp2 = [*moe, "parallel.pipeline=2", "cluster.gpus_per_node=4", "cluster.trainer_gpus=2"]
    pp2 += ["cluster.generator_gpus=2"]
    assert load_run_config(TINY, pp2).parallel.pipeline == 2
    msg = error_of(TINY, [*pp2, "model.recompute_activations=true"])
    assert "'algorithm.routing_replay'" in msg and "recompute" in msg
    msg = error_of(TINY, [*moe, "model.moe.capacity_factor=1.0"])
    assert "'algorithm.routing_replay'" in msg and "capacity_factor" in msg
    msg = error_of(TINY, [*moe, "rollout.enforce_eager=false"])
    assert "'rollout.enforce_eager'" in msg


def test_hf_path_model_is_checked_from_its_config_json(tmp_path):
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    config = {
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 120,
        "max_position_embeddings": 256,
    }
    # Llama-4 multimodal configs nest the text model's fields.
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Llama4ForConditionalGeneration"],
                "model_type": "llama4",
                "text_config": config,
            }
        )
    )
    base = [f"model.hf_path={model_dir}", "cluster.gpus_per_node=5", "cluster.generator_gpus=1"]
    msg = error_of(TINY, [*base, "parallel.tensor=4", "cluster.trainer_gpus=4"])
    assert "6 attention heads" in msg and str(model_dir) in msg
    assert (
        load_run_config(
            TINY, [*base, "parallel.tensor=2", "cluster.generator_gpus=3", "cluster.trainer_gpus=2"]
        ).parallel.tensor
        == 2
    )
    msg = error_of(TINY, [f"model.hf_path={tmp_path / 'missing'}"])
    assert "'model.hf_path'" in msg and "config.json" in msg


def test_base_chain_overrides_and_name(tmp_path):
    child = tiny_child(tmp_path, "optimizer:\n  lr: 3.0e-4\nbatch:\n  prompts_per_step: 4\n")
    cfg = load_run_config(child, ["optimizer.warmup_steps=0", "optimizer.eps=1e-8"])
    assert cfg.name == "recipe"  # the file stem
    assert cfg.optimizer.lr == 3e-4 and cfg.batch.prompts_per_step == 4
    assert cfg.optimizer.warmup_steps == 0 and cfg.optimizer.eps == 1e-8  # "1e-8" parses
    # Mappings merge: untouched keys come from the base chain (tiny_cpu <- base_scalerl).
    assert cfg.batch.samples_per_prompt == 8 and cfg.algorithm.loss == "cispo"
    assert cfg.data.source == "synthetic" and cfg.cluster.nodes == 1
    assert load_run_config(child, ["name=other"]).name == "other"


def test_linked_keys_follow_the_one_the_recipe_sets(tmp_path):
    cfg = load_run_config(TINY, ["batch.samples_per_prompt=4"])
    assert cfg.rollout.samples_per_prompt == 4
    cfg = load_run_config(TINY, ["model.fp32_head=false"])
    assert cfg.rollout.fp32_head is False
    # Setting the other side alone also links (base recipes set only model.fp32_head, so
    # here the rollout key wins over nothing).
    cfg = run_config_from_dict(
        {"name": "x", "model": {"preset": "tiny-llama"}, "rollout": {"fp32_head": False}}
    )
    assert cfg.model.fp32_head is False
    # A wrong value in the key the recipe set is blamed on that key, not on its copy.
    assert "'batch.samples_per_prompt'" in error_of(TINY, ["batch.samples_per_prompt=x"])


def test_yaml_round_trip_of_every_section(tmp_path):
    cfg = load_run_config(RECIPES / "scalerl_scout.yaml", ["cluster.container_mounts=[/a:/b]"])
    text = to_yaml(cfg)
    again = load_run_config(write_recipe(tmp_path, text, "scalerl_scout.yaml"))
    assert again == cfg
    assert isinstance(again.optimizer.betas, tuple) and again.optimizer.eps == 1e-15
    assert yaml.safe_load(text)["rollout"]["interruption"]["thinking_budget"] == [10240, 12288]


def test_defaults_are_the_scalerl_8b_run():
    cfg = run_config_from_dict({"name": "x", "model": {"preset": "llama3-8b"}})
    assert (cfg.optimizer.lr, cfg.optimizer.warmup_steps) == (5e-7, 100)
    assert (cfg.optimizer.eps, cfg.optimizer.weight_decay) == (1e-15, 0.01)
    assert cfg.batch.samples_per_step == 768
    assert (cfg.off_policy.mode, cfg.off_policy.max_lag) == ("pipeline_rl", 8)
    assert (cfg.validation.every_steps, cfg.validation.samples_per_prompt) == (100, 16)
    c = cfg.cluster
    assert (c.nodes * c.gpus_per_node, c.trainer_gpus, c.generator_gpus) == (80, 16, 64)
    with pytest.raises(ConfigError, match="'model'.*preset"):
        run_config_from_dict({"name": "x"})


def test_lr_warmup_then_constant():
    opt = OptimizerConfig(lr=5e-7, warmup_steps=100)
    assert opt.lr_factor(0) == pytest.approx(0.01)
    assert opt.lr_factor(49) == pytest.approx(0.5)
    assert opt.lr_factor(99) == 1.0 and opt.lr_factor(5000) == 1.0
    assert OptimizerConfig(warmup_steps=0).lr_factor(0) == 1.0


def test_diff_keys_lists_dotted_leaves():
    a = RunConfig(name="a")
    b = RunConfig(name="a")
    b.algorithm.loss = "ppo_clip"
    b.rollout.interruption.enabled = True
    assert diff_keys(a, b) == {"algorithm.loss", "rollout.interruption.enabled"}
    assert diff_keys(a, a) == set()


def test_schema_module_imports_no_torch_of_its_own():
    """The schema's own imports are torch-free (and, with megatron_rl.platform's lazy
    exports, nothing else pulls torch in either: see the next test)."""
    code = (
        "import sys, builtins\n"
        "real = builtins.__import__\n"
        "def guard(name, globals=None, *a, **k):\n"
        "    who = (globals or {}).get('__name__', '')\n"
        "    if name.split('.')[0] == 'torch' and who.startswith('megatron_rl.config'):\n"
        "        raise ImportError(f'{who} imports torch')\n"
        "    return real(name, globals, *a, **k)\n"
        "builtins.__import__ = guard\n"
        "import megatron_rl.config.sections, megatron_rl.config.schema, megatron_rl.config.checks\n"
        "from megatron_rl.config import load_run_config\n"
        f"load_run_config({str(TINY)!r})\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_cli_dry_run_prints_the_resolved_config(capsys, tmp_path):
    from megatron_rl.cli import main

    run_dir = tmp_path / "run"
    assert (
        main(["train", str(TINY), "optimizer.lr=2e-4", "--dry-run", "--run-dir", str(run_dir)]) == 0
    )
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["lr"] == 2e-4 and printed["name"] == "tiny_cpu"
    assert not run_dir.exists()  # a dry run writes nothing
    bad = tiny_child(tmp_path, "off_policy:\n  max_lag: 0\n")
    assert main(["train", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-rl train: error:") and "'off_policy.max_lag'" in err


BAD_BODIES = {
    "unknown-key": ("parallel:\n  tensr: 2\n", "'parallel.tensr'"),
    "wrong-type": ("batch:\n  prompts_per_step: lots\n", "'batch.prompts_per_step'"),
    # interruption budget beyond max tokens
    "impossible": (
        "rollout:\n  interruption:\n    thinking_budget: [40, 64]\n",
        "'rollout.interruption.thinking_budget'",
    ),
    "fill-not-positive": ("off_policy:\n  pool_fill: 0\n", "'off_policy.pool_fill'"),
    # 0.01 x 1 engine x 256 seqs = 2.56 sequences: not one prompt of 8 samples fits
    "fill-below-a-prompt": ("off_policy:\n  pool_fill: 0.01\n", "'off_policy.pool_fill'"),
}


@pytest.mark.parametrize("case", sorted(BAD_BODIES))
def test_cli_rejects_malformed_recipes_with_the_key(tmp_path, capsys, case):
    from megatron_rl.cli import main

    body, key = BAD_BODIES[case]
    assert main(["train", str(tiny_child(tmp_path, body)), "--dry-run"]) == 2
    out = capsys.readouterr()
    assert key in out.err and out.out == ""


def test_cli_process_exits_nonzero_without_traceback(tmp_path):
    body, key = BAD_BODIES["impossible"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl.cli",
            "train",
            str(tiny_child(tmp_path, body)),
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_recipe_file_errors_are_config_errors(tmp_path):
    loop_a = write_recipe(tmp_path, "base: b.yaml\n", "a.yaml")
    write_recipe(tmp_path, "base: a.yaml\n", "b.yaml")
    assert "loops back" in error_of(loop_a)
    assert "not found" in error_of(write_recipe(tmp_path, "base: nowhere.yaml\n", "c.yaml"))
    assert "mapping" in error_of(write_recipe(tmp_path, "- 1\n- 2\n", "d.yaml"))
    assert "not valid YAML" in error_of(write_recipe(tmp_path, "a: [1\n", "e.yaml"))
    assert "dotted.key=value" in error_of(TINY, ["optimizer.lr"])
    assert "'optimizer.lr' is not a section" in error_of(TINY, ["optimizer.lr.x=1"])
    assert "'optimizer': expected a mapping" in error_of(TINY, ["optimizer=3"])


def test_a_non_utf8_recipe_is_a_config_error_naming_file_and_line(tmp_path, capsys):
    from megatron_rl.cli import main

    path = tmp_path / "latin1.yaml"
    path.write_bytes(f"base: {TINY}\n# r\xe9glage\n".encode("latin-1"))
    assert f"{path} line 2: not UTF-8" in error_of(path)
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-rl train: error:") and "line 2: not UTF-8" in err


def test_overrides_may_follow_options(tmp_path, capsys):
    """`megatron-rl train RECIPE --run-dir X a.b=1`: argparse's parse_args stopped the
    positionals at the first option and rejected the override as unrecognized."""
    from megatron_rl.cli import main

    run_dir = tmp_path / "run"
    argv = ["train", str(TINY), "--run-dir", str(run_dir), "optimizer.lr=3e-4", "--dry-run"]
    assert main([*argv, "batch.prompts_per_step=8"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["optimizer"]["lr"] == 3e-4 and printed["batch"]["prompts_per_step"] == 8
    assert main(["plan", str(TINY), "--markdown", "parallel.tensor=1"]) == 0  # plan too


def test_a_run_dir_that_is_a_file_is_refused_clearly(tmp_path, capsys):
    from megatron_rl.cli import main

    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    for run_dir in (blocker, blocker / "run"):
        assert main(["train", str(TINY), "--run-dir", str(run_dir)]) == 2
        err = capsys.readouterr().err
        assert f"{blocker} is a file, not a directory" in err and "Traceback" not in err
    assert blocker.read_text() == "keep me"


def test_loading_a_recipe_imports_no_torch():
    """The config schema (all sections, model-shape checks included) is torch-free."""
    import subprocess
    import sys

    code = (
        "import sys; from megatron_rl.config import load_run_config; "
        "load_run_config('recipes/scalerl_scout.yaml'); print('torch' in sys.modules)"
    )
    root = __import__("pathlib").Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"

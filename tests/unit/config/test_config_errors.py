"""Config errors carry their key (``ConfigError.key``, the dotted recipe path) from the section
that found the problem, and loading the run config stays light (no transformers, scipy,
numpy or torch)."""

from __future__ import annotations

import importlib
import json
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, from_dict, load_run_config
from megatron_rl.rollout.config import RolloutConfig

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"
TWO_SOURCES = "data.sources=[{source: synthetic, name: a}, {source: synthetic, name: b, %s}]"


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["rollout.top_p=1.5"], "rollout.top_p"),
        (["rollout.batch_timeout_minutes=1"], "rollout.batch_timeout_minutes"),
        (["rollout.interruption.answer_budget=0"], "rollout.interruption.answer_budget"),
        # Mixture entries: the loader used to guess 'data' from "sources[1].weight must ...".
        ([TWO_SOURCES % "weight: 0"], "data.sources[1].weight"),
        ([TWO_SOURCES % "domain: bio"], "data.sources[1].domain"),
        ([TWO_SOURCES % "synthetic: {max_digits: 0}"], "data.sources[1].synthetic.max_digits"),
        ([TWO_SOURCES % "prompt_template: nothing"], "data.sources[1].prompt_template"),
        (["data.sources=[{source: synthetic}, {source: synthetic}]"], "data.sources[1].name"),
        (["data.synthetic.min_digits=3"], "data.synthetic.max_digits"),  # 2 < 3
        (["model.moe.aux_loss_coeff=-1"], "model.moe.aux_loss_coeff"),
        (["model.fp8=e4m3"], "model.fp8"),  # needs bfloat16; tiny_cpu is float32
        (["parallel.expert_tensor=0"], "parallel.expert_tensor"),
        (["algorithm.eps_max=0"], "algorithm.eps_max"),
        (["algorithm.mismatch=tls"], "algorithm.mismatch"),
        (["algorithm.mismatch=tis", "algorithm.mismatch_high=0.5"], "algorithm.mismatch_high"),
        (["algorithm.mismatch=icepop", "algorithm.mismatch_low=x"], "algorithm.mismatch_low"),
        (["reward.wall_timeout_s=0.5"], "reward.wall_timeout_s"),  # below timeout_s
        (["reward.answer_pattern=(unclosed"], "reward.answer_pattern"),
        (["forecast.ci=2"], "forecast.ci"),
        (["forecast.min_points=3"], "forecast.min_points"),
        (["optimizer.betas=[0.9, 1.5]"], "optimizer.betas"),
        (["cluster.container_mounts=[nocolon]"], "cluster.container_mounts"),
        (["off_policy.pool_fill=0.01"], "off_policy.pool_fill"),  # a cross-section check
        (["batch.samples_per_prompt=x"], "batch.samples_per_prompt"),  # a type error
        (["model.preset=null"], "model"),  # neither preset nor hf_path: the section
    ],
)
def test_errors_carry_the_dotted_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_run_config(TINY, overrides, check_model=False)
    assert info.value.key == key, str(info.value)
    assert str(info.value).startswith(f"recipe key '{key}': "), str(info.value)
    assert info.value.message and info.value.message in str(info.value)


def test_a_section_names_its_own_fields():
    """Validated alone, a section gives keys relative to itself; the loader prefixes them."""
    with pytest.raises(ConfigError) as info:
        RolloutConfig(top_p=0.0).validate()
    assert (info.value.key, info.value.message) == ("top_p", "must be in (0, 1], got 0.0")
    assert info.value.within("rollout").key == "rollout.top_p"
    assert info.value.within("data.sources[2]").key == "data.sources[2].top_p"
    assert ConfigError("[2].x", "m").within("a.b").key == "a.b[2].x"
    assert ConfigError("", "m").within("model").key == "model"
    keyless = ConfigError("recipe file not found: x.yaml")
    assert keyless.key is None and keyless.within("rollout") is keyless
    assert str(keyless) == "recipe file not found: x.yaml"
    assert isinstance(keyless, ValueError)


def test_config_errors_survive_pickling():
    """Errors cross process boundaries (preflight workers, spawned ranks) intact."""
    for err in (ConfigError("rollout.top_p", "must be in (0, 1]"), ConfigError("no key")):
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), back.key, back.message, str(back)) == (
            ConfigError,
            err.key,
            err.message,
            str(err),
        )


@dataclass
class _Leaf:
    x: int = 1

    def validate(self) -> None:
        if self.x < 0:
            raise ConfigError("x", f"must be >= 0, got {self.x}")
        if self.x == 7:
            raise ValueError("seven is not allowed")  # no key: blamed on the section


@dataclass
class _Root:
    leaf: _Leaf = field(default_factory=_Leaf)
    inner: _Leaf = field(default_factory=_Leaf)


def test_the_loader_puts_the_section_path_in_front():
    with pytest.raises(ConfigError) as info:
        from_dict(_Root, {"inner": {"x": -1}})
    assert info.value.key == "inner.x" and info.value.message == "must be >= 0, got -1"
    with pytest.raises(ConfigError) as info:
        from_dict(_Root, {"leaf": {"x": 7}}, "outer")
    assert (info.value.key, info.value.message) == ("outer.leaf", "seven is not allowed")
    with pytest.raises(ConfigError) as info:
        from_dict(_Root, {"leaf": {"y": 1}})
    assert info.value.key == "leaf.y" and "unknown key" in info.value.message


HEAVY = ("transformers", "scipy", "numpy", "torch", "megatron", "vllm")


def test_loading_the_run_config_imports_no_heavy_library():
    """``from megatron_rl.config import RunConfig`` and loading a recipe (without the model
    shape checks, which read a preset's HF config) import none of HEAVY. Package
    ``__init__`` files that imported them eagerly cost 1.5-1.9 s per start."""
    code = (
        "import json, sys, time\n"
        "t = time.perf_counter()\n"
        "from megatron_rl.config import RunConfig, load_run_config\n"
        "seconds = time.perf_counter() - t\n"
        f"load_run_config({str(TINY)!r}, check_model=False)\n"
        f"print(json.dumps([[m for m in {HEAVY!r} if m in sys.modules], seconds]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    loaded, seconds = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing the run config loaded {loaded} ({seconds:.2f} s)"


@pytest.mark.parametrize(
    "package",
    [
        "megatron_rl.data",
        "megatron_rl.models",
        "megatron_rl.rewards",
        "megatron_rl.rollout",
        "megatron_rl.scaling",
    ],
)
def test_lazy_packages_keep_their_public_names(package):
    module = importlib.import_module(package)
    names: dict[str, object] = {}
    exec(f"from {package} import {', '.join(module.__all__)}", names)
    assert all(names[name] is not None for name in module.__all__)
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError):
        module.no_such_name  # noqa: B018


def test_a_runs_forecast_settings_name_their_key(tmp_path):
    """``megatron-rl fit --watch RUN_DIR`` reads the run's config.yaml forecast section."""
    from megatron_rl.scaling.watch import read_settings

    (tmp_path / "config.yaml").write_text("forecast:\n  ci: 2.0\n")
    with pytest.raises(ConfigError) as info:
        read_settings(tmp_path)
    assert info.value.key == "forecast.ci", str(info.value)


def _config_classes(cls: type, seen: dict[str, type]) -> dict[str, type]:
    """Every dataclass of the tree under ``cls`` (fields, list items, optionals)."""
    import dataclasses
    import typing

    if not dataclasses.is_dataclass(cls) or cls.__qualname__ in seen:
        return seen
    seen[cls.__qualname__] = cls
    for hint in typing.get_type_hints(cls).values():
        for tp in (hint, *typing.get_args(hint)):
            if isinstance(tp, type):
                _config_classes(tp, seen)
    return seen


def test_no_section_validation_raises_a_keyless_error():
    """A ``raise ValueError`` in a section's validation would reach the user as an error about
    the whole section (the loader no longer guesses a key from the message): sections raise
    ``ConfigError(field, message)``."""
    import ast
    import inspect
    import textwrap

    from megatron_rl.config import RunConfig

    keyless = []
    for name, cls in _config_classes(RunConfig, {}).items():
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for method in ast.walk(tree):
            if not isinstance(method, ast.FunctionDef) or not (
                method.name == "validate" or method.name.startswith("_validate")
            ):
                continue
            for node in ast.walk(method):
                exc = node.exc if isinstance(node, ast.Raise) else None
                if isinstance(exc, ast.Call) and getattr(exc.func, "id", "") == "ValueError":
                    keyless.append(f"{name}.{method.name} (line {node.lineno} of the class)")
    assert len(_config_classes(RunConfig, {})) >= 15  # the walk reaches the nested sections
    assert keyless == []


def _float_keys(cls: type, prefix: str = "") -> list[str]:
    """Every float-typed key of a config tree (a float inside an optional counts)."""
    import dataclasses
    import typing

    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if typing.get_origin(tp) in (list, tuple, dict):
            continue  # entries of a list: data.sources[i].weight, checked below
        args = typing.get_args(tp) or (tp,)
        key = f"{prefix}{f.name}"
        nested = [a for a in args if dataclasses.is_dataclass(a)]
        if nested:
            keys += _float_keys(nested[0], key + ".")
        elif float in args:
            keys.append(key)
    return keys


def test_non_finite_floats_are_refused_at_load_for_every_float_key() -> None:
    """NaN passed every `<= 0` check (rollout.temperature, kv_cache_gb, the timeouts) and the
    run crashed after the warm start; inf overflowed a timedelta. Every float key refuses
    both, named, from YAML (.nan / .inf) and from a numeric string."""
    from megatron_rl.config.schema import RunConfig

    keys = _float_keys(RunConfig)
    assert {"rollout.temperature", "rollout.kv_cache_gb", "optimizer.lr"} <= set(keys)
    for key in keys:
        for value in (".nan", ".inf", "-.inf", "'nan'", "'1e999'"):
            with pytest.raises(ConfigError) as err:
                load_run_config(TINY, [f"{key}={value}"], check_model=False)
            assert err.value.key == key, (key, value, err.value)
            assert "finite" in str(err.value), (key, value, err.value)
    with pytest.raises(ConfigError) as err:
        load_run_config(TINY, [TWO_SOURCES % "weight: .nan"], check_model=False)
    assert err.value.key == "data.sources[1].weight"
    # A finite value still loads (the control).
    load_run_config(TINY, ["rollout.temperature=0.7"], check_model=False)


@pytest.mark.parametrize(
    "architecture,model_type", [("Qwen2ForCausalLM", "qwen2"), ("MistralForCausalLM", "mistral")]
)
def test_an_unsupported_architecture_is_refused_at_load_and_in_the_dry_run(
    tmp_path, capsys, architecture, model_type
):
    """A model megatron_rl does not build was refused only when the trainer built it, after
    the engines and data: now at load (and so in --dry-run), naming model.hf_path and the
    supported list. Meta's real Llama-3.1 config (the control) still loads."""
    from support.hf_configs import hf_dir_with_config, llama31_8b_config

    from megatron_rl.cli import main

    llama = hf_dir_with_config(tmp_path / "llama", llama31_8b_config())
    other = hf_dir_with_config(
        tmp_path / "other",
        {**llama31_8b_config(), "architectures": [architecture], "model_type": model_type},
    )
    overrides = ["model.preset=null", "parallel.tensor=1"]
    load_run_config(TINY, [*overrides, f"model.hf_path={llama}"])
    with pytest.raises(ConfigError) as err:
        load_run_config(TINY, [*overrides, f"model.hf_path={other}"])
    assert err.value.key == "model.hf_path"
    message = str(err.value)
    assert f"architecture {architecture!r} is not supported" in message
    assert "LlamaForCausalLM, Llama4ForCausalLM, Llama4ForConditionalGeneration" in message
    assert main(["train", str(TINY), *overrides, f"model.hf_path={other}", "--dry-run"]) == 2
    assert "model.hf_path" in capsys.readouterr().err


def test_a_misspelled_key_names_its_closest_match():
    """A typo listed the section's 35 keys but not the one meant."""
    with pytest.raises(ConfigError) as err:
        load_run_config(TINY, ["rollout.temprature=0.7"], check_model=False)
    assert err.value.key == "rollout.temprature"
    assert "did you mean 'temperature'?" in str(err.value)
    with pytest.raises(ConfigError) as err:  # nothing close: no guess
        load_run_config(TINY, ["rollout.zzz=1"], check_model=False)
    assert "did you mean" not in str(err.value) and "known keys here" in str(err.value)


def test_no_key_meaning_in_the_reference_is_cut_inside_parentheses_or_quotes():
    """config.md's meaning of reward.stated_answer stopped at '("The final answer is $X$.':
    the first sentence was cut at a full stop inside a quote. Every generated meaning closes
    what it opens."""
    from megatron_rl.config.reference import keys

    docs = {doc.key: doc.meaning for doc in keys()}
    assert docs["reward.stated_answer"].endswith("``stated.stated_answer``.")
    for key, meaning in docs.items():
        assert meaning.count("(") == meaning.count(")"), (key, meaning)
        assert meaning.count('"') % 2 == 0, (key, meaning)


def test_the_dry_run_refuses_a_data_field_the_run_would_refuse(tmp_path, capsys):
    """`--dry-run` passed a recipe whose data field was wrong (the run failed later): it reads
    the data as the run does and exits 2 naming the field and the file; the right field
    passes (the control)."""
    from megatron_rl.cli import main

    data = tmp_path / "mine.jsonl"
    data.write_text('{"question": "1+1?", "final": "2"}\n{"question": "2+2?", "final": "4"}\n')
    argv = ["train", str(TINY), f"data.source={data}", "data.format=custom"]
    argv += ["data.problem_field=question", "data.val_size=1", "--dry-run"]
    assert main([*argv, "data.answer_field=answr"]) == 2
    err = capsys.readouterr().err
    assert "field 'answr' is not in the dataset" in err and str(data) in err
    assert main([*argv, "data.answer_field=final"]) == 0
    assert "# first training prompt (id" in capsys.readouterr().out

"""One tolerant reader of HF configs (megatron_rl.models.hf_config): Scout's published
``"attn_temperature_tuning": 4`` (an int, which transformers 5.x refuses) loads through every
reader of the run; a value that is really wrong names the file and the key."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import transformers
from support.hf_configs import hf_dir_with_config, scout_config

from megatron_rl.models import hf_config

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "recipes" / "tiny_cpu.yaml"


def scout_with_int_tuning() -> dict:
    """Scout's config.json as its first published version and its fine-tunes have it:
    temperature tuning written as an int with the floor and scale beside it (fields the
    trimmed public copy dropped)."""
    config = scout_config()
    config["text_config"].update(attn_temperature_tuning=4, floor_scale=8192, attn_scale=0.1)
    return config


@pytest.fixture
def scout_dir(tmp_path) -> Path:
    return hf_dir_with_config(tmp_path / "scout", scout_with_int_tuning())


def test_transformers_refuses_the_int_that_the_loader_reads_as_true(scout_dir):
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    with pytest.raises(StrictDataclassFieldValidationError, match="attn_temperature_tuning"):
        transformers.AutoConfig.from_pretrained(scout_dir)  # why this module exists
    config = hf_config.load_hf_config(scout_dir)
    assert config.text_config.attn_temperature_tuning is True
    assert config.text_config.floor_scale == 8192 and config.text_config.num_local_experts == 16
    # the coerced config is the one transformers builds from the bool
    fixed = json.loads((scout_dir / "config.json").read_text())
    fixed["text_config"]["attn_temperature_tuning"] = True
    (scout_dir / "config.json").write_text(json.dumps(fixed))
    assert transformers.AutoConfig.from_pretrained(scout_dir).to_dict() == config.to_dict()


def test_every_reader_loads_scouts_int_tuning(scout_dir, tmp_path):
    from megatron_rl.config import load_run_config
    from megatron_rl.conversion import checkpoint
    from megatron_rl.conversion.hf import check_hf_dir
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.provider import load_hf_config
    from megatron_rl.planning.shapes import model_shapes
    from megatron_rl.preflight.context import PreflightContext
    from megatron_rl.preflight.model import check_model
    from megatron_rl.rollout.pool.launchers import hf_encoder, hf_text_config

    text = load_hf_config(ModelConfig(hf_path=str(scout_dir))).text_config
    assert text.attn_temperature_tuning is True
    check_hf_dir(scout_dir)
    assert hf_text_config(str(scout_dir)).attn_temperature_tuning is True
    tokenizer = hf_config.load_tokenizer(scout_dir)
    assert hf_encoder(str(scout_dir))("ab") == tokenizer.encode("ab", add_special_tokens=False)
    # a checkpoint's hf_config/ as an old save may have written it
    shutil.copytree(scout_dir, tmp_path / "ckpt" / checkpoint.HF_CONFIG_SUBDIR)
    assert checkpoint.load_hf_config(tmp_path / "ckpt").text_config.attn_temperature_tuning
    # the recipe loader (plan, --dry-run) and the preflight read it as the trainer does
    config = load_run_config(TINY, ["model.preset=llama4-scout", f"model.hf_path={scout_dir}"])
    shapes = model_shapes(config.model)
    assert shapes.temperature == tuple(not r for r in shapes.rope) and not all(shapes.rope)
    out = check_model(PreflightContext(config, tmp_path, tmp_path / "preflight"))
    assert out.passed, out.message


def test_convert_cli_reads_scouts_int_tuning(scout_dir, tmp_path, capsys):
    from megatron_rl.cli import main

    assert main(["convert", "hf-to-mcore", str(scout_dir), str(tmp_path / "o"), "--tp", "3"]) == 2
    # past the config: refused for the layout (3 does not divide Scout's 40 heads)
    assert "parallel.tensor=3 does not divide" in capsys.readouterr().err


def test_engine_args_give_vllm_a_coerced_config(tmp_path, tiny_hf_dirs, monkeypatch):
    from vllm.transformers_utils.config import get_config

    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the copy goes
    hf_dir = tmp_path / "tiny-llama4"
    shutil.copytree(tiny_hf_dirs["tiny-llama4"], hf_dir)
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    fields = json.loads((hf_dir / "config.json").read_text())
    assert engine_args(str(hf_dir), RolloutConfig(), 0).hf_config_path is None  # as it is
    (hf_dir / "config.json").write_text(json.dumps({**fields, "attn_temperature_tuning": 4}))
    with pytest.raises(Exception, match="attn_temperature_tuning"):
        get_config(str(hf_dir), trust_remote_code=False)  # vLLM's own reader
    args = engine_args(str(hf_dir), RolloutConfig(), 0)
    assert args.model == str(hf_dir) and args.hf_config_path != str(hf_dir)
    config = get_config(args.hf_config_path, trust_remote_code=False)
    assert config.attn_temperature_tuning is True
    assert config.num_local_experts == fields["num_local_experts"]
    generation = json.loads(Path(args.hf_config_path, "generation_config.json").read_text())
    assert generation == {"eos_token_id": 2}
    assert engine_args(str(hf_dir), RolloutConfig(), 1).hf_config_path == args.hf_config_path


def test_trainer_builds_and_loads_the_model_of_an_int_tuning_config(
    tmp_path, tiny_hf_dirs, megatron_single_rank
):
    """build_model + load_hf_weights (the trainer's start, modelopt's importer included) on
    tiny-llama4 with ``attn_temperature_tuning: 4``: the same model as with ``true``."""
    import torch

    from megatron_rl.conversion.hf import load_hf_weights
    from megatron_rl.models.arch import architecture_from_hf
    from megatron_rl.models.config import ModelConfig
    from megatron_rl.models.provider import build_model
    from megatron_rl.platform import ParallelConfig

    source = Path(tiny_hf_dirs["tiny-llama4"])
    hf_dir = tmp_path / "int-tuning"
    shutil.copytree(source, hf_dir)
    fields = json.loads((hf_dir / "config.json").read_text())
    assert fields["attn_temperature_tuning"] is True
    (hf_dir / "config.json").write_text(json.dumps({**fields, "attn_temperature_tuning": 4}))
    models = []
    for path in (source, hf_dir):
        cfg = ModelConfig(hf_path=str(path), dtype="float32", layer_spec="local")
        model = build_model(cfg, ParallelConfig())
        load_hf_weights(model, path, torch.float32)
        models.append(model)
    want = architecture_from_hf(transformers.AutoConfig.from_pretrained(source)).layout
    assert architecture_from_hf(hf_config.load_hf_config(hf_dir)).layout == want
    assert any(t is not None for t in want.temperature)
    tokens = torch.arange(1, 41).reshape(1, 40) % 100
    positions = torch.arange(40).reshape(1, 40)
    with torch.no_grad():
        a, b = (m(tokens, positions, attention_mask=None) for m in models)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "where, key, value",
    [
        ("text_config", "attn_temperature_tuning", "yes"),
        ("text_config", "num_attention_heads", "forty"),
        ("", "tie_word_embeddings", "no"),
    ],
)
def test_a_bad_value_names_the_file_and_the_key(tmp_path, where, key, value):
    from megatron_rl.config import ConfigError, load_run_config

    config = scout_with_int_tuning()
    (config[where] if where else config)[key] = value
    hf_dir = hf_dir_with_config(tmp_path / "bad", config)
    dotted = f"{where}.{key}" if where else key
    with pytest.raises(ValueError) as err:
        hf_config.load_hf_config(hf_dir)
    assert str(err.value).startswith(f"{hf_dir / 'config.json'}: {dotted}: "), err.value
    assert repr(value) in str(err.value) or value in str(err.value)
    with pytest.raises(ConfigError) as err:  # refused at load: plan, --dry-run, every job
        load_run_config(TINY, [f"model.hf_path={hf_dir}"])
    assert "model.hf_path" in str(err.value) and f"config.json: {dotted}: " in str(err.value)


@pytest.mark.parametrize("value, copied", [(4, True), (1, True), (0, True), (True, False)])
def test_vllm_gets_a_copy_exactly_when_a_field_was_coerced(tmp_path, monkeypatch, value, copied):
    """1 == True in Python: the copy is decided by the coercion, not by comparing values."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = scout_config()
    config["text_config"]["attn_temperature_tuning"] = value
    hf_dir = tmp_path / "scout"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    out = hf_config.vllm_config_dir(hf_dir)
    assert (out is not None) == copied
    if copied:
        text = json.loads(Path(out, "config.json").read_text())["text_config"]
        assert text["attn_temperature_tuning"] is bool(value)


def test_an_episode_engine_loads_its_tokenizer_through_vllm(tmp_path, tiny_hf_dirs, monkeypatch):
    """An engine that runs episodes loads its tokenizer (vLLM's registry, which reads
    config.json from the tokenizer's directory and lets the strict-dataclass error of
    ``attn_temperature_tuning: 4`` through): its engine args name the coerced copy, which holds
    the tokenizer, and vLLM's own ModelConfig and tokenizer registry load it."""
    from huggingface_hub.errors import StrictDataclassFieldValidationError
    from vllm.tokenizers.registry import cached_tokenizer_from_config, get_tokenizer

    from megatron_rl.data.tokenizer import build_char_tokenizer
    from megatron_rl.environments.config import EnvironmentConfig
    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the copy goes
    hf_dir = tmp_path / "tiny-llama4"
    shutil.copytree(tiny_hf_dirs["tiny-llama4"], hf_dir)
    want = build_char_tokenizer(tmp_path / "tok")
    for file in (tmp_path / "tok").iterdir():
        shutil.copy(file, hf_dir / file.name)
    fields = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**fields, "attn_temperature_tuning": 4}))
    with pytest.raises(StrictDataclassFieldValidationError, match="attn_temperature_tuning"):
        get_tokenizer(str(hf_dir))  # vLLM's registry on the original directory
    episodes = RolloutConfig(max_turns=2, environment=EnvironmentConfig(name="python_tool"))
    args = engine_args(str(hf_dir), episodes, 0)
    assert not args.skip_tokenizer_init and args.tokenizer == args.hf_config_path
    assert not any(Path(args.tokenizer).glob("*.safetensors"))  # the weights stay where they are
    model_config = args.create_model_config()  # vLLM's own reading of the engine args
    assert model_config.model == str(hf_dir) and model_config.tokenizer == args.tokenizer
    assert model_config.hf_config.attn_temperature_tuning is True
    tokenizer = cached_tokenizer_from_config(model_config)
    assert tokenizer.encode("a+b=c", add_special_tokens=False) == want.encode(
        "a+b=c", add_special_tokens=False
    )
    assert len(tokenizer) == len(want)


def test_engines_build_no_multimodal_processor(tmp_path, monkeypatch):
    """vLLM builds a Llama-4 engine's multimodal processor at start (renderers/base.py:181-196)
    from the original directory (``cached_processor_from_config`` loads ``model_config.model``,
    transformers_utils/processor.py:393-404), whose tokenizer transformers' AutoTokenizer
    builds from the original config.json (first, without the tokenizer it is given:
    processor.py:357-371): the same strict error. The engines generate from text only: they
    ask for the language model alone, and vLLM then makes no processor (every modality's
    limit is 0, config/model.py:941-955) nor the vision tower."""
    from vllm.config.multimodal import MultiModalConfig

    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine.vllm_engine import engine_args

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scout = hf_dir_with_config(tmp_path / "scout", scout_with_int_tuning())
    with pytest.raises(Exception, match="attn_temperature_tuning"):
        transformers.AutoTokenizer.from_pretrained(scout)  # what the processor's load does
    args = engine_args(str(scout), RolloutConfig(), 0)
    assert args.language_model_only is True
    # Scout's real config (Llama4ForConditionalGeneration): vLLM's registry reads the copy
    from vllm.tokenizers.registry import get_tokenizer

    want = hf_config.load_tokenizer(scout).encode("x=1", add_special_tokens=False)
    assert get_tokenizer(args.tokenizer).encode("x=1", add_special_tokens=False) == want
    mm = MultiModalConfig(language_model_only=args.language_model_only)
    assert mm.get_limit_per_prompt("image") == 0 and mm.get_limit_per_prompt("video") == 0

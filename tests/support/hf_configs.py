"""The real public config files of the production models (tests/data/hf_configs, copies of
the public checkpoints' files; origins in tests/data/README.md) and HF directories made around them."""

from __future__ import annotations

import json
from pathlib import Path

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
LLAMA31_8B = HF_CONFIGS / "Llama-3.1-8B-Instruct.config.json"
SCOUT_TRIMMED = HF_CONFIGS / "Llama-4-Scout-17B-16E-Instruct.config.aiconfigurator-trimmed.json"


def llama31_8b_config() -> dict:
    """meta-llama/Llama-3.1-8B-Instruct's config.json (byte-verified copy)."""
    return json.loads(LLAMA31_8B.read_text())


def scout_config() -> dict:
    """Llama-4-Scout-17B-16E-Instruct's config.json as far as the files allow: the trimmed
    public copy (every architecture field of the text and vision models) plus the one field
    the model check compares that the trimming dropped, ``tie_word_embeddings``, where Meta's
    file keeps it: at the top level, not in text_config."""
    config = json.loads(SCOUT_TRIMMED.read_text())
    assert "tie_word_embeddings" not in config
    assert "tie_word_embeddings" not in config["text_config"]
    return {**config, "tie_word_embeddings": False}


def hf_dir_with_config(path: Path, config: dict) -> Path:
    """An HF directory with ``config`` as its config.json, the name of a weights file (no
    tensor in it: for the readers of names and configs) and a tokenizer that loads (the
    character tokenizer)."""
    from megatron_rl.data.tokenizer import build_char_tokenizer

    tok = path.parent / f"{path.name}_tok"
    build_char_tokenizer(tok)
    path.mkdir()
    for file in tok.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "model-00001-of-00004.safetensors").write_bytes(b"")
    return path

"""The one reader of an HF directory's ``config.json`` (and of its tokenizer, which transformers
builds from that config too).

Published configs carry values the installed transformers refuses: Llama-4 Scout's first
config.json (and fine-tunes and copies made from it) has ``"attn_temperature_tuning": 4``, an
int, the default of transformers 4.51's Llama4TextConfig; transformers 5.x's strict config
dataclasses want a bool and raise. Every reader (model builder, conversion, engines, launchers,
preflight, the config checks of ``plan`` and ``--dry-run``) goes through :func:`load_hf_config`,
which coerces the known fields (:data:`COERCED_FIELDS`) and, on a value that is really wrong,
raises a ``ValueError`` naming the file and the key. vLLM reads config.json itself, and its
tokenizer registry reads it again from the tokenizer's directory: an engine whose config needs
coercion gets a coerced copy with the tokenizer beside it (:func:`vllm_config_dir`).

Imports transformers on first use only: the config checks import this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
# The architectures megatron_rl builds (config.json "architectures"): Llama 3.x and Llama 4.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Llama4ForCausalLM",
    "Llama4ForConditionalGeneration",
)

# field -> the type transformers 5.x declares, for values published with another type whose
# meaning is unambiguous. attn_temperature_tuning: Llama-4's first configs wrote 4 (truthy:
# transformers 4.51 and vLLM test it as a bool: ``if self.attn_temperature_tuning and nope``).
COERCED_FIELDS: dict[str, type] = {"attn_temperature_tuning": bool}

# where a multimodal config nests its models' configs (Llama-4: text_config, vision_config)
_SUB_CONFIGS = ("text_config", "vision_config")

# what vllm_config_dir leaves out of its copy: the weights (every other top-level file is
# small: the tokenizer's, generation_config.json, hf_quant_config.json, the processor's)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")


def _config_path(hf_dir: str | Path) -> Path:
    path = Path(hf_dir)
    return path if path.name == CONFIG_NAME and path.is_file() else path / CONFIG_NAME


_LOGGED: set[tuple[str, str]] = set()  # (file, key) coerced and said so once


def _coerce(fields: dict[str, Any], where: str, path: Path) -> bool:
    """Coerce ``fields`` (one config level) in place; True when anything changed."""
    changed = False
    for key, kind in COERCED_FIELDS.items():
        value = fields.get(key)
        if kind is bool and isinstance(value, int) and not isinstance(value, bool):
            fields[key] = bool(value)
            if (str(path), where + key) not in _LOGGED:
                _LOGGED.add((str(path), where + key))
                logger.info(
                    "%s: %s%s %r read as %r (transformers 5.x takes a bool)",
                    path,
                    where,
                    key,
                    value,
                    fields[key],
                )
            changed = True
    return changed


def coerce_config_dict(fields: dict[str, Any], path: Path | str = CONFIG_NAME) -> bool:
    """Coerce the known fields of a config.json dict, its nested model configs included, in
    place; True when anything changed. ``path`` names the file in the log line."""
    changed = _coerce(fields, "", Path(path))
    for sub in _SUB_CONFIGS:
        if isinstance(fields.get(sub), dict):
            changed |= _coerce(fields[sub], f"{sub}.", Path(path))
    return changed


def _read_json(path: Path) -> dict[str, Any]:
    try:
        fields = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: unreadable: {err}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: not a JSON object")
    return fields


def read_config_dict(hf_dir: str | Path) -> dict[str, Any]:
    """``hf_dir``'s config.json (or the file itself) as a dict, known fields coerced. Raises
    ValueError naming the file when it is missing or not a JSON object."""
    path = _config_path(hf_dir)
    fields = _read_json(path)
    coerce_config_dict(fields, path)
    return fields


def _key_path(fields: dict[str, Any], key: str) -> str:
    """``key`` as a dotted path in ``fields`` (``text_config.attn_temperature_tuning``)."""
    if key in fields:
        return key
    for sub in _SUB_CONFIGS:
        if isinstance(fields.get(sub), dict) and key in fields[sub]:
            return f"{sub}.{key}"
    return key


def config_from_dict(fields: dict[str, Any], path: Path | str = CONFIG_NAME) -> Any:
    """The transformers config object of a config.json dict (as ``AutoConfig`` builds it:
    the class of its ``model_type``). Raises ValueError naming ``path`` and the key on a
    value transformers refuses."""
    import transformers

    try:
        from huggingface_hub.errors import StrictDataclassFieldValidationError as strict
    except ImportError:  # a huggingface_hub without strict dataclasses (transformers 4.x)
        strict = ()
    fields = dict(fields)
    model_type = fields.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(f"{path}: model_type {model_type!r} is not one transformers knows")
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(fields)
    except strict as err:
        # "Validation error for field 'X':\n    TypeError: ..."
        head, _, cause = str(err).partition("\n")
        key = head.split("'")[1] if head.count("'") >= 2 else "?"
        raise ValueError(f"{path}: {_key_path(fields, key)}: {cause.strip()}") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {type(err).__name__}: {err}") from None


def load_hf_config(hf_dir: str | Path) -> Any:
    """The transformers config of the HF directory ``hf_dir`` (a ``PretrainedConfig``; the
    multimodal one for Llama-4, whose ``get_text_config()`` is the text model's), read
    through :func:`read_config_dict`. ValueError names the file (and key) on a bad config."""
    path = _config_path(hf_dir)
    config = config_from_dict(read_config_dict(path), path)
    config.name_or_path = str(path.parent)
    return config


def load_text_config(hf_dir: str | Path) -> Any:
    """The config of ``hf_dir``'s text model (the whole config for a text-only model)."""
    config = load_hf_config(hf_dir)
    return getattr(config, "text_config", config)


def load_tokenizer(hf_dir: str | Path) -> Any:
    """``hf_dir``'s tokenizer. transformers' AutoTokenizer builds the model's config first
    (to pick the tokenizer class) and would fail on the values this module coerces: it is
    given the config read here."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(hf_dir), config=load_hf_config(hf_dir))


def vllm_config_dir(hf_dir: str | Path) -> str | None:
    """A directory vLLM can read ``hf_dir``'s config and tokenizer from (``EngineArgs``'s
    ``hf_config_path`` and ``tokenizer``): None when config.json loads as it is, else a copy
    with the coerced config.json and every other top-level file but the weights (the
    tokenizer's files, generation_config.json, ...) in the temp directory, named by its
    content (made once per node; concurrent makers race harmlessly).

    The tokenizer goes with it because vLLM 0.32's ``get_tokenizer`` reads config.json from
    the tokenizer's directory (``vllm/tokenizers/registry.py:237-245``, ``get_config``) and
    suppresses only ValueError and OSError: the strict-dataclass error of the original file
    escaped and every engine that loads a tokenizer (episodes) failed at start."""
    path = _config_path(hf_dir)
    fields = _read_json(path)
    if not coerce_config_dict(fields, path):
        return None
    config_from_dict(fields, path)  # a config transformers refuses fails here, not in vLLM
    text = json.dumps(fields, indent=2, sort_keys=True)
    copied = sorted(
        file
        for file in path.parent.iterdir()
        if file.is_file() and file.name != CONFIG_NAME and not file.name.endswith(_WEIGHT_SUFFIXES)
    )
    digest = hashlib.sha256(text.encode())
    for file in copied:
        digest.update(file.name.encode() + file.read_bytes())
    out = Path(tempfile.gettempdir()) / f"megatron_rl-hf-config-{digest.hexdigest()[:16]}"
    if not (out / CONFIG_NAME).is_file():
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
        (tmp / CONFIG_NAME).write_text(text)
        for file in copied:
            shutil.copy(file, tmp / file.name)
        try:
            os.rename(tmp, out)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)

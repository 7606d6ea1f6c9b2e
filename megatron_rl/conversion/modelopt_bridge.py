"""nvidia-modelopt's Megatron <-> HF importer/exporter, made to work for our models.

Two gaps are filled here, in one place:

1. modelopt 0.47.0 imports ``megatron.core.models.hybrid.hybrid_model.HybridModel``, which
   megatron-core 0.16.1 does not have (it calls it ``MambaModel``). The failing import silently
   disables modelopt's whole Megatron plugin, and the exporter then dies with
   ``NameError: HybridModel``. We register that module name as an alias before importing modelopt.
2. modelopt maps Llama-4 only as ``Llama4ForConditionalGeneration`` (keys under
   ``language_model.``) and only MoE MLPs. A text-only ``Llama4ForCausalLM`` uses the same
   tensors without the prefix, and interleaved dense layers use ``feed_forward.{gate,up,down}_proj``:
   a declarative mapping for both, registered in modelopt's own tables.

And one of its reading: modelopt's importer reads the HF directory's config.json with
``transformers.AutoConfig`` itself (:func:`importer_config` gives it ours, coerced).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path


def _alias_hybrid_model() -> None:
    name = "megatron.core.models.hybrid.hybrid_model"
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass
    from megatron.core.models.mamba.mamba_model import MambaModel

    package = types.ModuleType("megatron.core.models.hybrid")
    package.__path__ = []
    module = types.ModuleType(name)
    module.HybridModel = MambaModel
    package.hybrid_model = module
    sys.modules.setdefault("megatron.core.models.hybrid", package)
    sys.modules[name] = module


def _strip_prefix(mapping: dict, rules: dict) -> dict:
    """Copy a Llama4ForConditionalGeneration mapping to the text-only key layout."""
    out = {}
    for key, value in mapping.items():
        if isinstance(value, bool):
            out[key] = value
            continue
        new = type(value).__new__(type(value))
        new.__dict__.update(value.__dict__)
        name = value.target_name_or_prefix
        for old, replacement in rules.items():
            name = name.replace(old, replacement)
        new.target_name_or_prefix = name
        out[key] = new
    return out


def _register_llama4_text() -> None:
    from modelopt.torch.export.plugins import mcore_common
    from modelopt.torch.export.plugins.mcore_custom import (
        COL_TP,
        ROW_TP,
        GatedMLPMerging,
        GatedMLPSlicing,
        NameRemapping,
    )
    from modelopt.torch.export.plugins.mcore_llama import (
        llama4_causal_lm_export,
        llama4_causal_lm_import,
    )

    rules = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
    dense_import = {
        "linear_fc1": GatedMLPMerging("language_model.model.layers.{}.feed_forward.", COL_TP),
        "linear_fc2": NameRemapping(
            "language_model.model.layers.{}.feed_forward.down_proj.", ROW_TP
        ),
    }
    dense_export = {
        "linear_fc1": GatedMLPSlicing("language_model.model.layers.{}.feed_forward."),
        "linear_fc2": NameRemapping("language_model.model.layers.{}.feed_forward.down_proj."),
    }
    for table, base, dense in (
        (mcore_common.all_mcore_hf_import_mapping, llama4_causal_lm_import, dense_import),
        (mcore_common.all_mcore_hf_export_mapping, llama4_causal_lm_export, dense_export),
    ):
        full = {**base, **{k: v for k, v in dense.items() if k not in base}}
        table["Llama4ForConditionalGeneration"] = full
        table["Llama4ForCausalLM"] = _strip_prefix(full, rules)


_READY = False


def modelopt_export():
    """``modelopt.torch.export`` with the gaps above filled (idempotent)."""
    global _READY
    if not _READY:
        _alias_hybrid_model()
        _register_llama4_text()
        _READY = True
    import modelopt.torch.export as mte

    return mte


@contextlib.contextmanager
def importer_config(hf_dir: str | Path) -> Iterator[None]:
    """Around the construction of modelopt's ``GPTModelImporter`` for ``hf_dir``: its
    ``transformers.AutoConfig.from_pretrained(hf_dir)`` returns the config read by
    :func:`megatron_rl.models.hf_config.load_hf_config` (modelopt 0.47 takes no config
    object, and transformers 5.x refuses e.g. Scout's ``attn_temperature_tuning: 4``).
    Other paths are read by transformers as usual."""
    import transformers

    from megatron_rl.models.hf_config import load_hf_config

    config = load_hf_config(hf_dir)
    original = transformers.AutoConfig.__dict__["from_pretrained"]
    wanted = Path(hf_dir).resolve()

    def from_pretrained(cls, path, *args, **kwargs):
        if Path(path).resolve() == wanted:
            return config
        return original.__func__(cls, path, *args, **kwargs)

    transformers.AutoConfig.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        transformers.AutoConfig.from_pretrained = original

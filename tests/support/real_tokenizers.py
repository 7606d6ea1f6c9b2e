"""Meta's real Llama-3.1 and Llama-4 tokenizers as Hugging Face fast tokenizers, and Meta's
reference chat formatters for them (the ``llama-models`` package, a test dependency).

``llama_models`` ships Meta's tiktoken BPE files (``llama3/tokenizer.model``,
``llama4/tokenizer.model``) with the tokenizer classes that define their special tokens and
the ``ChatFormat`` classes that turn a dialog into token ids. transformers'
``TikTokenConverter`` turns a BPE file into a fast tokenizer; the directory it is saved to is
laid out as a Hub checkpoint's:

- Llama-3.1: the Hub's ``tokenizer_config.json`` of meta-llama/Llama-3.1-8B-Instruct
  (``tests/data/hf_configs``: its 256 special tokens at ids 128000-128255, its chat template,
  ``<|begin_of_text|>`` as BOS and ``<|eot_id|>`` as EOS) and a ``tokenizer.json`` whose
  post-processor adds ``<|begin_of_text|>`` (as the Hub file's does).
- Llama-4: no Hub tokenizer file is public without the gated repository: the special tokens
  are those of Meta's ``llama4/tokenizer.py`` (``Tokenizer.special_tokens``, ids from 200000),
  the split pattern its ``O200K_PATTERN``, and the chat template the one transformers' Llama-4
  processor ships (``processing_llama4.chat_template``, the Hub file's).

Built once per test session (the conversion takes seconds), under pytest's temporary
directory; ``build_*`` are called by the session fixtures of ``tests/conftest.py``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

HF_CONFIGS = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
LLAMA31_TOKENIZER_CONFIG = HF_CONFIGS / "Llama-3.1-8B-Instruct.tokenizer_config.json"

# Meta's Llama-3 split pattern (llama_models/llama3/tokenizer.py, Tokenizer.pat_str).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _convert(model_file: Path, pattern: str, specials: dict[str, int], bos: str) -> Any:
    """The tiktoken BPE ``model_file`` as a ``tokenizers.Tokenizer``: Meta's split pattern,
    byte-level BPE, ``specials`` at their ids and ``bos`` added by the post-processor."""
    from tokenizers import AddedToken, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(model_file), pattern=pattern).converted()
    base = backend.get_vocab_size()
    ordered = sorted(specials.items(), key=lambda item: item[1])
    assert ordered[0][1] == base, (ordered[0], base)  # specials follow the BPE ranks
    assert [i for _, i in ordered] == list(range(base, base + len(ordered)))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, _ in ordered])
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials[bos])]
            ),
        ]
    )
    return backend


def build_llama31_tokenizer(out_dir: Path) -> Any:
    """Llama-3.1-8B-Instruct's tokenizer (Meta's BPE file, the Hub's tokenizer_config.json)."""
    from llama_models.llama3.tokenizer import Tokenizer as MetaTokenizer
    from transformers import AutoTokenizer

    meta = MetaTokenizer.get_instance()
    assert meta.model._pat_str == LLAMA3_PATTERN
    model_file = Path(sys.modules[MetaTokenizer.__module__].__file__).parent / "tokenizer.model"
    config = json.loads(LLAMA31_TOKENIZER_CONFIG.read_text())
    names = {v["content"]: int(k) for k, v in config["added_tokens_decoder"].items()}
    # The Hub's named tokens have Meta's ids. llama-models 0.3.0 (shared with Llama-3.2)
    # also names two of the Hub's reserved ones (128005 <|step_id|>, 128011 <|image|>), which
    # shifts the numbering of the reserved names after them.
    named = {t: i for t, i in meta.special_tokens.items() if "reserved" not in t}
    assert {t: names.get(t) for t in named} == {**named, "<|step_id|>": None, "<|image|>": None}
    assert sorted(names.values()) == sorted(meta.special_tokens.values())
    backend = _convert(model_file, LLAMA3_PATTERN, names, "<|begin_of_text|>")
    out_dir.mkdir(parents=True, exist_ok=True)
    backend.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_bytes(LLAMA31_TOKENIZER_CONFIG.read_bytes())
    return AutoTokenizer.from_pretrained(str(out_dir))


def build_llama4_tokenizer(out_dir: Path) -> Any:
    """Llama-4's tokenizer: Meta's BPE file and special tokens, the Hub's chat template."""
    from llama_models.llama4.tokenizer import Tokenizer as MetaTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.models.llama4.processing_llama4 import chat_template

    meta = MetaTokenizer.get_instance()
    model_file = Path(sys.modules[MetaTokenizer.__module__].__file__).parent / "tokenizer.model"
    backend = _convert(model_file, meta.O200K_PATTERN, meta.special_tokens, "<|begin_of_text|>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
        pad_token="<|finetune_right_pad|>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = chat_template
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out_dir))


def meta_llama3_format() -> Any:
    """Meta's Llama-3 ``ChatFormat`` (llama_models.llama3.chat_format) on its tokenizer."""
    from llama_models.llama3.chat_format import ChatFormat
    from llama_models.llama3.tokenizer import Tokenizer

    return ChatFormat(Tokenizer.get_instance())


def meta_llama4_format() -> Any:
    """Meta's Llama-4 ``ChatFormat`` (llama_models.llama4.chat_format) on its tokenizer.

    The module imports torchvision for its image transforms, which this environment does not
    have (the CPU setup removes it: tools/setup_venv.sh); text dialogs never reach them, so
    an empty stand-in module is enough to import it."""
    stub = "torchvision" not in sys.modules
    if stub:
        tv = types.ModuleType("torchvision")
        tv.transforms = types.ModuleType("torchvision.transforms")
        tv.transforms.functional = types.ModuleType("torchvision.transforms.functional")
        sys.modules.update(
            {
                "torchvision": tv,
                "torchvision.transforms": tv.transforms,
                "torchvision.transforms.functional": tv.transforms.functional,
            }
        )
    try:
        from llama_models.llama4.chat_format import ChatFormat
        from llama_models.llama4.tokenizer import Tokenizer
    finally:
        if stub:
            for name in (
                "torchvision.transforms.functional",
                "torchvision.transforms",
                "torchvision",
            ):
                sys.modules.pop(name, None)
    return ChatFormat(Tokenizer.get_instance())

"""A character-level Hugging Face tokenizer for the tiny models of the embedded default.

One token per character of printable ASCII (plus newline and tab), with ``<think>``,
``</think>`` and ``\\boxed{`` as single (non-special, so never skipped when decoding)
tokens, special ``<pad> <bos> <eos> <unk>``, and reserved tokens padding the vocabulary to
a multiple of ``vocab_multiple`` (divisible by the tensor-parallel size). Saved as a
``PreTrainedTokenizerFast`` directory (``tokenizer.json`` + config), which
``transformers.AutoTokenizer`` and vLLM load like any HF tokenizer.

BOS: as Llama's, the chat template writes ``<bos>`` itself (a chat prompt is tokenized
without special tokens, as ``apply_chat_template(tokenize=True)`` does:
``megatron_rl.data.rendering.prompt_token_ids``) and the post-processor adds it to text
encoded with ``add_special_tokens=True`` (a plain prompt). The chat template is deliberately
terse (every character is a token): system and user turns end with a newline, the assistant
turn with ``<eos>``, and the generation prompt is empty.
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
WORD_TOKENS: tuple[str, ...] = ("<think>", "</think>", "\\boxed{")
CHARACTERS: str = "".join(c for c in string.printable if c not in "\r\x0b\x0c")

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- else -%}{{ message['content'] + '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def char_vocab(vocab_multiple: int = 64) -> dict[str, int]:
    """Token -> id: specials, word tokens, characters, then ``<|reserved_k|>`` padding."""
    if vocab_multiple < 1:
        raise ValueError(f"vocab_multiple must be >= 1, got {vocab_multiple}")
    tokens = [*SPECIAL_TOKENS, *WORD_TOKENS, *CHARACTERS]
    padding = -len(tokens) % vocab_multiple
    tokens += [f"<|reserved_{k}|>" for k in range(padding)]
    return {token: i for i, token in enumerate(tokens)}


def build_char_tokenizer(out_dir: str | os.PathLike, vocab_multiple: int = 64) -> Any:
    """Write the character tokenizer to ``out_dir`` and return it as
    ``transformers.AutoTokenizer`` loads it; ``len(tokenizer) % vocab_multiple == 0``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = char_vocab(vocab_multiple)
    # BPE without merges splits every word into its characters; no pre-tokenizer, so
    # spaces and newlines are ordinary characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORD_TOKENS])
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    # Return what every consumer gets: the tokenizer as loaded from the directory.
    loaded = AutoTokenizer.from_pretrained(str(out_dir))
    assert len(loaded) == len(vocab), (len(loaded), len(vocab))
    return loaded

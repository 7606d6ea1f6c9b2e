"""Tokenizers for the tool-format tests: the embedded character tokenizer (a real HF
tokenizer), with the special tokens of Llama-3.1's and Qwen's tool formats added the way
those families' vocabularies hold them (Llama's as special tokens; Qwen's ``<tool_call>`` as
ordinary added tokens, ``<|im_start|>`` / ``<|im_end|>`` as special ones)."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from megatron_rl.data.tokenizer import build_char_tokenizer

LLAMA_SPECIALS = (
    "<|python_tag|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
)
QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>")
QWEN_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char"))


@pytest.fixture(scope="session")
def llama_tokenizer(tmp_path_factory):
    tokenizer = build_char_tokenizer(tmp_path_factory.mktemp("llama"))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIALS])
    return tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer(tmp_path_factory):
    tokenizer = build_char_tokenizer(tmp_path_factory.mktemp("qwen"))
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TOKENS])
    tokenizer.chat_template = "{{ '<tool_call>' }}"  # detect_format reads the template
    return tokenizer

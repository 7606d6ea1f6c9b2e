"""Prompt rendering: the problem in the configured template, through the chat template.

Token ids of a prompt come from :func:`prompt_token_ids` (or :func:`encode_prompt`) on every
path (training, validation, warm start, probes, the preflight, the length filter, the dry
run): a prompt rendered by the chat template is tokenized as ``apply_chat_template(...,
tokenize=True)`` and vLLM's chat endpoint tokenize it, without the tokenizer's special
tokens, since chat templates write their BOS themselves (Llama-3.1's and Llama-4's
``<|begin_of_text|>``; Qwen's none). Tokenized with them, a Llama prompt would start with two
BOS tokens, a form the instruct model never saw. A plain prompt (no chat template) is
tokenized as a completion request is, with the tokenizer's special tokens (its BOS, if it
adds one).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.data.config import DataConfig


def render_prompt(
    problem: str,
    config: DataConfig,
    tokenizer: Any = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for ``problem``.

    ``config.prompt_template`` (with ``{problem}`` replaced; other braces are literal) is
    the user turn. With ``use_chat_template`` and a tokenizer that has a chat template, the
    turns (optional system prompt, user) go through it with the generation prompt and
    ``template_kwargs`` (multi-turn episodes: the tool offered the model family's way,
    ``environments.registry.template_kwargs``); otherwise the text is the system prompt line
    (if any) and the user turn. With ``prefill_think`` the thinking tag is appended unless
    the template already ends with it.
    """
    user = config.prompt_template.replace("{problem}", problem)
    if config.use_chat_template and getattr(tokenizer, "chat_template", None):
        messages = (
            [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        )
        messages.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    else:
        text = f"{config.system_prompt}\n{user}" if config.system_prompt else user
    if config.prefill_think and not text.rstrip().endswith(config.think_start):
        text += config.think_start
    return text


def uses_chat_template(config: DataConfig, tokenizer: Any) -> bool:
    """Whether :func:`render_prompt` renders through ``tokenizer``'s chat template."""
    return bool(config.use_chat_template and getattr(tokenizer, "chat_template", None))


def prompt_token_ids(text: str, config: DataConfig, tokenizer: Any) -> list[int]:
    """The token ids of ``text``, a prompt :func:`render_prompt` made with ``config`` and
    ``tokenizer``: through the chat template, exactly ``apply_chat_template(...,
    tokenize=True)``'s ids (no special tokens added: the template writes its own BOS); a
    plain prompt with the tokenizer's special tokens (see the module docstring)."""
    chat = uses_chat_template(config, tokenizer)
    return list(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def encode_prompt(
    problem: str,
    config: DataConfig,
    tokenizer: Any,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[int]]:
    """(text, token ids) of ``problem``'s prompt: :func:`render_prompt` then
    :func:`prompt_token_ids`."""
    text = render_prompt(problem, config, tokenizer, template_kwargs)
    return text, prompt_token_ids(text, config, tokenizer)


def prompt_token_count(
    problem: str,
    config: DataConfig,
    tokenizer: Any,
    template_kwargs: dict[str, Any] | None = None,
) -> int:
    """Number of tokens of the prompt as the model sees it (BOS included)."""
    return len(encode_prompt(problem, config, tokenizer, template_kwargs)[1])


def sft_example(
    problem: str,
    solution: str,
    config: DataConfig,
    tokenizer: Any = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, str]:
    """(prompt text, target text) of a supervised warm-start example.

    The target is the worked ``solution`` minus the thinking tag the prompt already ends
    with (``prefill_think``), so that prompt + target is exactly one well-formed response.
    Tokenize the prompt with :func:`prompt_token_ids`, the target without special tokens,
    and append the tokenizer's EOS token to it when training on token ids.
    """
    prompt = render_prompt(problem, config, tokenizer, template_kwargs)
    target = solution
    if prompt.rstrip().endswith(config.think_start) and target.startswith(config.think_start):
        target = target[len(config.think_start) :]
        if prompt.endswith("\n"):
            target = target.lstrip("\n")
    return prompt, target

"""Prompt rendering: the problem in the configured template, through the chat template.

The rendered text carries no BOS token: tokenize it with ``add_special_tokens=True`` (the
default of HF tokenizers and of vLLM text prompts) so the tokenizer adds exactly one.
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


def prompt_token_count(problem: str, config: DataConfig, tokenizer: Any) -> int:
    """Number of tokens of the rendered prompt, BOS included."""
    return len(tokenizer(render_prompt(problem, config, tokenizer))["input_ids"])


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
    Append the tokenizer's EOS token to the target when training on token ids.
    """
    prompt = render_prompt(problem, config, tokenizer, template_kwargs)
    target = solution
    if prompt.rstrip().endswith(config.think_start) and target.startswith(config.think_start):
        target = target[len(config.think_start) :]
        if prompt.endswith("\n"):
            target = target.lstrip("\n")
    return prompt, target

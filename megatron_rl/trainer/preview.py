"""The first training prompt as the model will see it: its text and token ids, for
``megatron-rl train RECIPE --dry-run`` (to debug a chat template: a BOS written twice, a
system prompt, the tool offered in episodes, a thinking prefill).

The tokenizer and the prompts are the run's (``trainer.setup.build_run``): the tokenizer of
``model.hf_path`` (a preset: the character tokenizer it starts with), the data loaded, split
and length-filtered as the run does, the chat template given the environment's tool, and
the ids of ``data.rendering.encode_prompt``. A dataset on the hub is read from the local
cache only (a dry run downloads nothing); when something cannot be read, the preview says
why instead.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_rl.config.schema import RunConfig


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """datasets and huggingface_hub in offline mode (cached files only) for the block."""
    import datasets.config
    import huggingface_hub.constants

    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


def first_prompt(config: RunConfig, tokenizer: Any = None) -> tuple[int, str, list[int]]:
    """(prompt id, text, token ids) of the first training prompt of ``config``'s data.
    ``tokenizer``: the run's (None: loaded as the run loads it)."""
    from megatron_rl.config.checks import prompt_token_limit
    from megatron_rl.data import encode_prompt, load_prompt_data
    from megatron_rl.trainer.setup import template_kwargs

    with contextlib.ExitStack() as stack:
        if tokenizer is None:
            if config.model.hf_path:
                from megatron_rl.models.hf_config import load_tokenizer

                tokenizer = load_tokenizer(config.model.hf_path)
            else:  # a preset starts with the character tokenizer (trainer.setup.prepare_hf_dir)
                from megatron_rl.data.tokenizer import build_char_tokenizer

                tokenizer = build_char_tokenizer(stack.enter_context(tempfile.TemporaryDirectory()))
        tools = template_kwargs(config, tokenizer)
        with _hub_offline():
            data = load_prompt_data(
                config.data, tokenizer, max_tokens=prompt_token_limit(config), template_kwargs=tools
            )
        prompt_id = data.train_ids[0]
        text, ids = encode_prompt(
            data.get(prompt_id).problem, data.config_of(prompt_id), tokenizer, tools
        )
    return prompt_id, text, ids


def _local_data(config: RunConfig) -> bool:
    """Whether every data source is on this machine (a file, a directory or synthetic): its
    errors are the run's. A hub dataset may just be absent from this machine's cache."""
    from megatron_rl.data.config import SYNTHETIC_CODE_SOURCE, SYNTHETIC_SOURCE

    synthetic = (SYNTHETIC_SOURCE, SYNTHETIC_CODE_SOURCE)
    return all(
        s.config.source in synthetic or Path(s.config.source).exists()
        for s in config.data.resolve()
    )


def preview_lines(config: RunConfig) -> list[str]:
    """The first training prompt's text (as a JSON string: newlines and special tokens
    visible) and ids, as YAML comment lines (the dry run's output stays the config's YAML)."""
    from megatron_rl.data import DataError

    try:
        prompt_id, text, ids = first_prompt(config)
    except DataError as err:
        if _local_data(config):  # a field or file the run would refuse: refused here too
            raise
        return [f"# first training prompt: not shown ({type(err).__name__}: {err})"]
    except Exception as err:  # noqa: BLE001 - e.g. a hub dataset not in the local cache
        return [f"# first training prompt: not shown ({type(err).__name__}: {err})"]
    return [
        f"# first training prompt (id {prompt_id}) as the model sees it:",
        f"# text: {json.dumps(text, ensure_ascii=False)}",
        f"# token ids ({len(ids)}): {ids}",
    ]

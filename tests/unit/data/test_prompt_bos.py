"""One BOS on every prompt path (issue 46, section 1), with Meta's real tokenizers.

Llama-3.1's and Llama-4's chat templates write ``<|begin_of_text|>`` into the text; the run
tokenized that text with the tokenizer's special tokens on, which added a second one
(``[128000, 128000, 128006, ...]``). A prompt's ids must be exactly what
``apply_chat_template(..., tokenize=True, add_generation_prompt=True)`` gives, whether the
template writes a BOS (Llama) or not (Qwen), and, for Llama, what Meta's reference formatter
(``llama_models``' ``ChatFormat.encode_dialog_prompt``) gives for the same dialog.

The paths: ``data.encode_prompt`` (what all use), the run's ``encode`` (trainer.setup's
``prompt_encoder``: training and validation rollouts, probes and the preflight's engine
checks take their ids from it), the warm start's examples, the length filter, the dry run's
preview; and no module renders a prompt without going through them (the last test).
Each test here but the last failed before the fix (two BOS tokens for Llama, one for the
Qwen-style template where apply_chat_template has none).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from megatron_rl.data import DataConfig, encode_prompt, load_prompt_data
from megatron_rl.data.rendering import prompt_token_count

ROOT = Path(__file__).resolve().parents[3]
SYSTEM = "Solve the problem; put the final answer in \\boxed{}."
TEMPLATE = "Problem: {problem}"
PROBLEM = "What is 12 + 30?"
BOS = {"llama31": 128000, "llama4": 200000}
# Qwen2.5 / Qwen3's turn layout: the template writes no BOS (Qwen has none)
QWEN_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def qwen_style_tokenizer(tmp_path_factory):
    """The character tokenizer (its post-processor adds ``<bos>`` to text encoded with special
    tokens) with a Qwen-style chat template, which writes none."""
    from megatron_rl.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(tmp_path_factory.mktemp("qwen_style"))
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


@pytest.fixture(params=["llama31", "llama4", "qwen_style"])
def named_tokenizer(request):
    fixture = {"llama31": "llama31_tokenizer", "llama4": "llama4_tokenizer"}
    return request.param, request.getfixturevalue(
        fixture.get(request.param, "qwen_style_tokenizer")
    )


def data_config(**overrides) -> DataConfig:
    return DataConfig(system_prompt=SYSTEM, prompt_template=TEMPLATE, **overrides)


def chat_ids(tokenizer, **kwargs) -> list[int]:
    """The reference: transformers' apply_chat_template, tokenized."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TEMPLATE.replace("{problem}", PROBLEM)},
    ]
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, **kwargs
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_prompt_ids_are_apply_chat_templates(named_tokenizer):
    name, tokenizer = named_tokenizer
    text, ids = encode_prompt(PROBLEM, data_config(), tokenizer)
    assert ids == chat_ids(tokenizer)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    if name in BOS:
        assert ids[0] == BOS[name] and ids.count(BOS[name]) == 1
    else:  # the template writes no BOS: neither does apply_chat_template, nor do we
        assert tokenizer.bos_token_id not in ids


def test_llama_prompts_equal_metas_reference_formatter(llama31_tokenizer, llama4_tokenizer):
    from llama_models.datatypes import RawMessage
    from support.real_tokenizers import meta_llama3_format, meta_llama4_format

    user = RawMessage(role="user", content=TEMPLATE.replace("{problem}", PROBLEM))
    # Llama-3.1's HF template opens the system turn with its knowledge and date lines; Meta's
    # formatter writes the system message as given
    dated = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" + SYSTEM
    meta3 = meta_llama3_format().encode_dialog_prompt(
        [RawMessage(role="system", content=dated), user]
    )
    assert encode_prompt(PROBLEM, data_config(), llama31_tokenizer)[1] == meta3.tokens
    meta4 = meta_llama4_format().encode_dialog_prompt(
        [RawMessage(role="system", content=SYSTEM), user]
    )
    assert encode_prompt(PROBLEM, data_config(), llama4_tokenizer)[1] == meta4.tokens
    assert meta3.tokens[:2] == [128000, 128006] and meta4.tokens[:2] == [200000, 200005]


def test_tool_prompt_is_apply_chat_templates_with_the_tool(llama31_tokenizer):
    # multi-turn episodes: the tool offered the llama3 format's way (builtin_tools)
    tools = {"builtin_tools": ["code_interpreter"]}
    text, ids = encode_prompt(PROBLEM, data_config(), llama31_tokenizer, tools)
    assert "Environment: ipython" in text
    assert ids == chat_ids(llama31_tokenizer, **tools) and ids.count(128000) == 1
    assert prompt_token_count(PROBLEM, data_config(), llama31_tokenizer, tools) == len(ids)


def test_plain_prompt_has_the_tokenizers_bos(llama31_tokenizer):
    # no chat template: a completion request, tokenized with the tokenizer's BOS
    config = data_config(use_chat_template=False)
    text, ids = encode_prompt(PROBLEM, config, llama31_tokenizer)
    assert text == f"{SYSTEM}\nProblem: {PROBLEM}"
    assert ids == [128000] + llama31_tokenizer(text, add_special_tokens=False)["input_ids"]


def write_rows(path: Path, n: int = 6) -> Path:
    rows = [
        {
            "problem": f"What is {i} + {i}?" + " Show the steps." * i,
            "answer": str(2 * i),
            "solution": f"\\boxed{{{2 * i}}}",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_run_encoder_warm_start_and_length_filter_have_one_bos(tmp_path, named_tokenizer):
    from megatron_rl.trainer.setup import prompt_encoder
    from megatron_rl.trainer.warm_start import warm_start_examples

    name, tokenizer = named_tokenizer
    config = data_config(source=str(write_rows(tmp_path / "rows.jsonl")), val_size=2)
    data = load_prompt_data(config, tokenizer)
    encode = prompt_encoder(data, tokenizer, {})
    for prompt_id in data.train_ids + data.val_ids:
        problem = data.get(prompt_id).problem
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TEMPLATE.replace("{problem}", problem)},
        ]
        out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        reference = list(out["input_ids"] if hasattr(out, "keys") else out)
        assert encode(prompt_id) == reference, (name, prompt_id)
    examples = warm_start_examples(data, tokenizer)
    assert [prompt for prompt, _ in examples] == [encode(i) for i in data.train_ids]
    for prompt_id, (_, target) in zip(data.train_ids, examples):
        solution = data.get(prompt_id).solution
        expected = tokenizer(solution, add_special_tokens=False)["input_ids"]
        assert target == expected + [tokenizer.eos_token_id]
    # the length filter counts the same ids: a limit of the longest keeps all, one less drops
    longest = max(len(encode(i)) for i in data.train_ids + data.val_ids)
    kept = load_prompt_data(config, tokenizer, max_tokens=longest)
    assert sorted(kept.train_ids + kept.val_ids) == sorted(data.train_ids + data.val_ids)
    cut = load_prompt_data(config, tokenizer, max_tokens=longest - 1)
    left = [i for i in data.train_ids + data.val_ids if len(encode(i)) < longest]
    assert sorted(cut.train_ids + cut.val_ids) == sorted(left) and len(left) == 5


def test_dry_run_preview_shows_the_first_prompt_as_the_model_sees_it(
    llama31_tokenizer, monkeypatch
):
    import megatron_rl.config.checks as checks
    from megatron_rl.config import load_run_config
    from megatron_rl.trainer.preview import first_prompt

    # Llama-3.1's template writes ~30 tokens around a tiny problem, past the tiny model's
    # positions: no length limit here
    config = load_run_config(ROOT / "recipes/tiny_cpu.yaml", ["data.max_prompt_tokens=0"])
    monkeypatch.setattr(checks, "prompt_token_limit", lambda config: None)
    prompt_id, text, ids = first_prompt(config, llama31_tokenizer)
    assert text.startswith("<|begin_of_text|><|start_header_id|>")
    assert ids[:2] == [128000, 128006] and ids.count(128000) == 1
    assert llama31_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_dry_run_prints_the_first_prompt_text_and_ids(capsys):
    import yaml

    from megatron_rl.cli import main

    assert main(["train", str(ROOT / "recipes/tiny_cpu.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["name"] == "tiny_cpu"  # still the config's YAML
    lines = [line for line in out.splitlines() if line.startswith("# ")]
    assert lines[0].startswith("# first training prompt (id ")
    text = json.loads(lines[1].removeprefix("# text: "))
    count, ids = lines[2].removeprefix("# token ids (").split("): ")
    ids = json.loads(ids)
    # the character tokenizer: one token per character, <bos> (id 1) written by its template
    assert text.startswith("<bos>") and ids[0] == 1 and ids.count(1) == 1
    assert int(count) == len(ids)


def test_no_module_renders_a_prompt_outside_the_encoding_functions():
    """Every prompt's ids come from data.rendering (encode_prompt / prompt_token_ids): a call
    of render_prompt elsewhere would tokenize its text its own way."""
    callers = []
    for path in (ROOT / "megatron_rl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name == "render_prompt":
                    callers.append(path.relative_to(ROOT).as_posix())
    assert set(callers) == {"megatron_rl/data/rendering.py"}

"""Synthetic arithmetic task and the character tokenizer of the tiny models."""

from __future__ import annotations

import json
import operator
import re

import pytest

from megatron_rl.data import (
    DataConfig,
    SyntheticConfig,
    load_prompt_data,
    render_prompt,
    sft_example,
)
from megatron_rl.data.synthetic import (
    generate_problems,
    main,
    make_problem,
    write_synthetic_dataset,
)
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.rewards import RewardConfig
from megatron_rl.rewards.math import prepare

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
PROBLEM_RE = re.compile(r"(\d+)([+\-*])(\d+)")
SOLUTION_RE = re.compile(r"<think>(.*)</think>\\boxed\{(-?\d+)\}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("chartok"))


def test_answers_are_exact_and_solutions_well_formed():
    config = SyntheticConfig(
        operations=("add", "sub", "mul"), min_digits=1, max_digits=3, num_problems=600
    )
    problems = generate_problems(config)
    assert len(problems) == 600
    assert len({p["problem"] for p in problems}) == 600
    assert {p["operation"] for p in problems} == {"add", "sub", "mul"}
    for p in problems:
        a, op, b = PROBLEM_RE.fullmatch(p["problem"]).groups()
        assert int(p["answer"]) == OPS[op](int(a), int(b))
        assert 1 <= p["digits"] <= 3 and p["digits"] == max(len(a), len(b))
        pad, boxed = SOLUTION_RE.fullmatch(p["solution"]).groups()
        assert boxed == p["answer"]


def _digit(number: str, i: int) -> int:
    return int(number[-1 - i]) if i < len(number) else 0


def test_addition_scratchpad_steps_are_true_and_determine_the_answer():
    for p in generate_problems(SyntheticConfig(min_digits=1, max_digits=4, num_problems=300)):
        a, _, b = PROBLEM_RE.fullmatch(p["problem"]).groups()
        pad = SOLUTION_RE.fullmatch(p["solution"]).group(1)
        sums = []
        for i, step in enumerate(pad.split(",")):
            terms, total = step.split("=")
            values = [int(t) for t in terms.split("+")]
            assert sum(values) == int(total)
            # The step adds the i-th digits from the right (0 past the end), plus the carry.
            assert values[:2] == [_digit(a, i), _digit(b, i)]
            assert (len(values) == 3) == (i > 0 and sums[-1] >= 10)
            sums.append(int(total))
        rebuilt = str(sums[-1]) + "".join(str(s % 10) for s in reversed(sums[:-1]))
        assert int(rebuilt) == int(p["answer"])


def test_subtraction_and_multiplication_scratchpads():
    assert make_problem(85, 47, "sub")["solution"] == "<think>15-7=8,8-1-4=3</think>\\boxed{38}"
    assert (
        make_problem(47, 85, "sub")["solution"] == "<think>85-47:15-7=8,8-1-4=3</think>\\boxed{-38}"
    )
    assert make_problem(47, 6, "mul")["solution"] == "<think>7*6=42,4*6+4=28</think>\\boxed{282}"
    assert make_problem(12, 34, "mul")["answer"] == "408"
    config = SyntheticConfig(operations=("sub", "mul"), max_digits=3, num_problems=400)
    for p in generate_problems(config):
        pad = SOLUTION_RE.fullmatch(p["solution"]).group(1).split(":")[-1]
        steps = [step.split("=") for step in pad.split(",")]
        if p["operation"] == "sub":
            digits = []
            for lhs, rhs in steps:
                first, *rest = (int(t) for t in lhs.split("-"))
                assert first - sum(rest) == int(rhs) and 0 <= int(rhs) <= 9
                digits.append(rhs)
            assert int("".join(reversed(digits))) == abs(int(p["answer"]))
        else:
            for lhs, rhs in steps:  # every product and sum written is true
                assert sum(_product(term) for term in lhs.split("+")) == int(rhs)


def _product(term: str) -> int:
    result = 1
    for factor in term.split("*"):
        result *= int(factor)
    return result


def test_generation_is_deterministic_and_capped_by_the_problem_space(tmp_path):
    config = SyntheticConfig(num_problems=200, seed=3)
    first = write_synthetic_dataset(config, tmp_path / "a.jsonl").read_bytes()
    assert write_synthetic_dataset(config, tmp_path / "b.jsonl").read_bytes() == first
    other = SyntheticConfig(num_problems=200, seed=4)
    assert write_synthetic_dataset(other, tmp_path / "c.jsonl").read_bytes() != first
    # One-digit addition has exactly 10 * 10 distinct problems.
    assert len(generate_problems(SyntheticConfig(max_digits=1, num_problems=1000))) == 100


def test_synthetic_source_goes_through_the_same_loader_and_reward(tmp_path):
    config = DataConfig(
        source="synthetic",
        cache_dir=str(tmp_path),
        val_size=50,
        synthetic=SyntheticConfig(num_problems=400),
    )
    data = load_prompt_data(config)
    assert len(data.prompts) == 400 and len(data.val_ids) == 50
    assert list(tmp_path.glob("synthetic-*.jsonl"))
    reward = RewardConfig()
    for prompt in data.prompts:
        assert prompt.kind == "math" and prompt.solution is not None
        assert prepare(prompt.solution, prompt.answer, reward) == 1.0
        wrong = prompt.solution.replace(f"{{{prompt.answer}}}", f"{{{int(prompt.answer) + 1}}}")
        assert prepare(wrong, prompt.answer, reward) == -1.0


def test_tokenizer_loads_with_auto_tokenizer_and_pads_the_vocab(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    assert tokenizer.name_or_path
    assert len(loaded) == len(tokenizer) and len(loaded) % 64 == 0
    assert len(build_char_tokenizer(tmp_path / "t128", vocab_multiple=128)) % 128 == 0
    for token in ("<think>", "</think>", "\\boxed{"):
        ids = loaded(token, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and loaded.convert_ids_to_tokens(ids) == [token]
    ids = loaded("ab")["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == 3
    assert loaded.eos_token_id is not None and loaded.pad_token_id is not None
    assert loaded.chat_template is not None


def test_tokenizer_round_trips_synthetic_problems_and_keeps_them_short(tokenizer):
    config = DataConfig(
        synthetic=SyntheticConfig(operations=("add", "sub", "mul"), max_digits=3, num_problems=300)
    )
    for p in generate_problems(config.synthetic):
        text = p["problem"] + "\n" + p["solution"]
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert tokenizer.unk_token_id not in ids
    # Lowest difficulty: chat-rendered prompt plus response (with EOS) well under 64 tokens.
    easiest = generate_problems(SyntheticConfig(max_digits=1, num_problems=100))
    longest = max(
        len(tokenizer(render_prompt(p["problem"], config, tokenizer))["input_ids"])
        + len(tokenizer(p["solution"], add_special_tokens=False)["input_ids"])
        + 1
        for p in easiest
    )
    assert longest < 32, longest


def test_cli_writes_a_dataset(tmp_path):
    out = tmp_path / "task.jsonl"
    assert (
        main([str(out), "--ops", "add", "mul", "--digits", "1", "2", "--num-problems", "30"]) == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 30 and {"problem", "answer", "solution"} <= set(rows[0])


def test_sft_examples_and_prompt_length_filter(tmp_path, tokenizer):
    problem = make_problem(47, 85, "add")
    config = DataConfig()
    prompt, target = sft_example(problem["problem"], problem["solution"], config, tokenizer)
    assert (prompt, target) == ("<bos>47+85\n", problem["solution"])  # the template's BOS
    prefilled = DataConfig(prefill_think=True, use_chat_template=False)
    prompt, target = sft_example(problem["problem"], problem["solution"], prefilled, tokenizer)
    assert prompt + target == "47+85" + problem["solution"] and prompt.endswith("<think>")
    # max_prompt_tokens drops prompts by rendered length: "1+2\n" is 5 tokens with BOS.
    synthetic = SyntheticConfig(min_digits=1, max_digits=3, num_problems=300)
    limited = DataConfig(
        cache_dir=str(tmp_path), val_size=20, max_prompt_tokens=6, synthetic=synthetic
    )
    data = load_prompt_data(limited, tokenizer)
    kept = [data.get(i).problem for i in data.train_ids + data.val_ids]
    assert kept and all(len(p) + 2 <= 6 for p in kept)
    assert len(data.train_ids) + len(data.val_ids) < 300
    with pytest.raises(ValueError, match="tokenizer"):
        load_prompt_data(limited)

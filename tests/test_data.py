"""Prompt data: loaders, validation split, rendering, sampler (resume, retirement)."""

from __future__ import annotations

import json
import random

import pytest

from megatron_rl.data import (
    DataConfig,
    PromptSampler,
    RetirementTracker,
    has_reward_variance,
    load_prompt_data,
    render_prompt,
)
from megatron_rl.data.prompts import Prompt, split_ids


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def polaris_rows(n):
    return [
        {"problem": f"What is {i} + {i}?", "answer": str(2 * i), "difficulty": i % 5}
        for i in range(n)
    ]


def test_polaris_jsonl_and_validation_split(tmp_path):
    path = write_jsonl(tmp_path / "polaris.jsonl", polaris_rows(50))
    data = load_prompt_data(DataConfig(source=str(path), val_size=10, split_seed=3))
    assert [p.prompt_id for p in data.prompts] == list(range(50))
    assert data.get(7) == Prompt(7, "What is 7 + 7?", answer="14", domain="math")
    assert data.get(7).kind == "math" and data.get(7).reference == "14"
    assert len(data.val_ids) == 10 and len(data.train_ids) == 40
    assert not set(data.val_ids) & set(data.train_ids)
    # Deterministic by seed, different for another seed.
    again = load_prompt_data(DataConfig(source=str(path), val_size=10, split_seed=3))
    other = load_prompt_data(DataConfig(source=str(path), val_size=10, split_seed=4))
    assert again.val_ids == data.val_ids
    assert other.val_ids != data.val_ids


def test_duplicate_problems_never_leak_into_training():
    prompts = [Prompt(i, f"problem {i % 20}", answer="1") for i in range(100)]
    train_ids, val_ids = split_ids(prompts, 10, seed=0)
    val_problems = {prompts[i].problem for i in val_ids}
    assert val_problems.isdisjoint(prompts[i].problem for i in train_ids)
    assert len(val_ids) == 10
    with pytest.raises(ValueError, match="val_size"):
        split_ids(prompts, 100, seed=0)


def test_parquet_arrow_and_saved_dataset_directories(tmp_path):
    import datasets

    rows = polaris_rows(12)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "p.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    arrow_file = next((tmp_path / "saved").glob("*.arrow"))
    expected = [(r["problem"], r["answer"]) for r in rows]
    for source in ("p.parquet", "saved", "saved_dict", arrow_file.relative_to(tmp_path)):
        data = load_prompt_data(DataConfig(source=str(tmp_path / source), val_size=2))
        assert [(p.problem, p.answer) for p in data.prompts] == expected, source


def test_deepcoder_and_custom_fields(tmp_path):
    tests = json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}])
    rows = [
        {"problem": "Double it.", "tests": tests, "metadata": "{}", "starter_code": ""},
        {
            "problem": "Solve.",
            "tests": tests,
            "metadata": json.dumps({"func_name": "f"}),
            "starter_code": "def f(x):",
        },
    ]
    path = write_jsonl(tmp_path / "deepcoder.jsonl", rows)
    data = load_prompt_data(DataConfig(source=str(path), format="deepcoder", val_size=0))
    first, second = data.prompts
    assert first.kind == "code" and first.reference == {"tests": tests, "fn_name": None}
    assert second.tests["fn_name"] == "f" and "def f(x):" in second.problem
    custom_path = write_jsonl(
        tmp_path / "custom.jsonl", [{"q": "1+1", "a": 2}, {"q": "2+2", "a": 4}]
    )
    custom = DataConfig(
        source=str(custom_path), format="custom", problem_field="q", answer_field="a", val_size=0
    )
    assert [(p.problem, p.answer) for p in load_prompt_data(custom).prompts] == [
        ("1+1", "2"),
        ("2+2", "4"),
    ]
    with pytest.raises(ValueError, match="'question'"):
        load_prompt_data(
            DataConfig(
                source=str(custom_path), format="custom", problem_field="question", answer_field="a"
            )
        )


def test_bad_sources_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_data(DataConfig(source=str(tmp_path / "missing.jsonl")))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="no data files"):
        load_prompt_data(DataConfig(source=str(tmp_path)))
    with pytest.raises(ValueError, match="format"):
        DataConfig(format="alpaca").validate()
    with pytest.raises(ValueError, match="prompt_template"):
        DataConfig(prompt_template="no placeholder").validate()
    with pytest.raises(ValueError, match="synthetic.max_digits"):
        DataConfig(
            synthetic=DataConfig().synthetic.__class__(min_digits=3, max_digits=2)
        ).validate()


class FakeChatTokenizer:
    chat_template = "set"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        turns = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return turns + "<assistant>"


def test_render_prompt_with_and_without_chat_template():
    config = DataConfig(prompt_template="Solve: {problem} Answer in \\boxed{}.")
    plain = render_prompt("1+1", config)
    assert plain == "Solve: 1+1 Answer in \\boxed{}."
    chat = render_prompt(
        "1+1",
        DataConfig(system_prompt="Be brief.", prompt_template="{problem}"),
        FakeChatTokenizer(),
    )
    assert chat == "<system>Be brief.</system><user>1+1</user><assistant>"
    no_chat = DataConfig(use_chat_template=False, prefill_think=True)
    assert render_prompt("1+1", no_chat, FakeChatTokenizer()) == "1+1<think>"
    already = DataConfig(prefill_think=True)

    class ThinkingTemplate(FakeChatTokenizer):
        def apply_chat_template(self, *args, **kwargs):
            return super().apply_chat_template(*args, **kwargs) + "<think>\n"

    assert render_prompt("x", already, ThinkingTemplate()).count("<think>") == 1


class SetTracker:
    """A minimal retirement tracker (the protocol, not the algorithms' PassRateTracker)."""

    def __init__(self):
        self.retired = set()

    def is_retired(self, prompt_id: int) -> bool:
        return prompt_id in self.retired


def test_sampler_epochs_are_permutations_and_seeded():
    ids = list(range(100, 130))
    sampler = PromptSampler(ids, seed=5)
    first, second = sampler.next_prompts(30), sampler.next_prompts(30)
    assert sorted(first) == ids and sorted(second) == ids
    assert first != second and first != ids
    assert sampler.epoch == 1
    assert PromptSampler(ids, seed=5).next_prompts(30) == first
    assert PromptSampler(ids, seed=6).next_prompts(30) != first
    assert PromptSampler(ids, shuffle=False).next_prompts(35) == ids + ids[:5]
    assert isinstance(SetTracker(), RetirementTracker)


def test_sampler_resume_mid_epoch_matches_uninterrupted_run():
    ids = list(range(37))
    tracker_a, tracker_b = SetTracker(), SetTracker()
    reference = PromptSampler(ids, seed=1, tracker=tracker_a)
    interrupted = PromptSampler(ids, seed=1, tracker=tracker_b)
    rng = random.Random(0)
    expected, got = [], []
    resumed_at = None
    for step in range(20):
        n = rng.randint(1, 9)
        state = interrupted.state_dict()
        if resumed_at is None and step >= 8 and 0 < state["position"] < len(ids):
            # Save mid-epoch (after the first epoch), "restart", restore into a fresh sampler.
            state = json.loads(json.dumps(state))
            interrupted = PromptSampler(ids, seed=1, tracker=tracker_b)
            interrupted.load_state_dict(state)
            resumed_at = (step, state["epoch"])
        expected.append(reference.next_prompts(n))
        got.append(interrupted.next_prompts(n))
        for tracker, batch in ((tracker_a, expected[-1]), (tracker_b, got[-1])):
            tracker.retired.update(p for p in batch if p % 5 == 0)  # same retirement rule
    assert resumed_at is not None and resumed_at[1] >= 1
    assert reference.epoch >= 2
    assert got == expected
    assert interrupted.num_drawn == reference.num_drawn
    with pytest.raises(ValueError, match="other training prompts"):
        PromptSampler(ids[:-1], seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(ids, seed=2).load_state_dict(state)


def test_retired_prompts_never_reappear():
    tracker = SetTracker()
    sampler = PromptSampler(list(range(20)), seed=0, tracker=tracker)
    seen_after = []
    for _ in range(10):
        batch = sampler.next_prompts(7)
        seen_after.extend(p for p in batch if p in tracker.retired)
        tracker.retired.update(p for p in batch if p < 10)
    assert seen_after == []
    assert tracker.retired == set(range(10))
    later = sampler.next_prompts(40)
    assert sorted(set(later)) == list(range(10, 20))
    tracker.retired.update(range(20))
    with pytest.raises(RuntimeError, match="retired"):
        sampler.next_prompts(1)


def test_sampler_with_the_algorithms_pass_rate_tracker():
    from megatron_rl.algorithms.pass_rate import PassRateTracker

    tracker = PassRateTracker(threshold=0.9)
    sampler = PromptSampler(list(range(8)), seed=0, tracker=tracker)
    batch = sampler.next_prompts(8)
    easy = batch[:4]
    tracker.update(
        [p for p in batch for _ in range(4)],
        [1.0 if p in easy else -1.0 for p in batch for _ in range(4)],
    )
    assert set(sampler.next_prompts(12)) == set(batch[4:])


def test_has_reward_variance():
    assert has_reward_variance([1, -1]) and has_reward_variance([-1.0, -1.0, 0.5])
    assert (
        not has_reward_variance([1, 1])
        and not has_reward_variance([1])
        and not (has_reward_variance([]))
    )


def test_special_judge_code_problems_are_dropped_with_a_count(tmp_path, caplog):
    import logging

    plain = json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}])
    spj = json.dumps({"inputs": ["4\n"], "outputs": ["1 3\n"], "special_judge": True})
    rows = [
        {"problem": "Double it.", "tests": plain, "metadata": "{}"},
        {"problem": "Any pair summing to n.", "tests": spj, "metadata": "{}"},
        {"problem": "Any order.", "tests": plain, "metadata": "{}", "special_judge": True},
        {"problem": "Triple it.", "tests": plain, "metadata": "{}"},
    ]
    path = write_jsonl(tmp_path / "deepcoder.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.prompts"):
        data = load_prompt_data(DataConfig(source=str(path), format="deepcoder", val_size=0))
    assert [p.problem for p in data.prompts] == ["Double it.", "Triple it."]
    assert [p.prompt_id for p in data.prompts] == [0, 1]
    assert any("dropped 2 code problems" in r.getMessage() for r in caplog.records)

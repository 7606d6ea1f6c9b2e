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
    assert [data.prompts[i].problem for i in data.train_ids] == ["Double it.", "Triple it."]
    assert data.train_ids == [0, 3]  # ids stay row indices
    assert data.dropped["special_judge/" + data.sources[0].name] == 2
    assert any("dropped 2 code problems" in r.getMessage() for r in caplog.records)


# --- Data checked at the door (issue 30, section 4, items 5, 8 and 10) ---------------------


def test_rows_without_a_usable_answer_are_dropped_never_scored(tmp_path, caplog):
    """A Polaris-layout parquet (nullable string answer column, as the hub exports it) with
    a few bad rows: a null answer used to become the reference 'None', which the response
    \\boxed{None} matched for the full reward."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_rl.rewards.math import score

    rows = polaris_rows(40)
    bad = {3: None, 11: "None", 17: "", 29: "  null "}
    for i, answer in bad.items():
        rows[i]["answer"] = answer
    table = pa.table(
        {
            "problem": [r["problem"] for r in rows],
            "answer": pa.array([r["answer"] for r in rows], pa.string()),
            "difficulty": [f"{r['difficulty']}/8" for r in rows],
        }
    )
    pq.write_table(table, tmp_path / "polaris.parquet")
    with caplog.at_level("WARNING"):
        data = load_prompt_data(DataConfig(source=str(tmp_path / "polaris.parquet"), val_size=6))
    used = set(data.train_ids) | set(data.val_ids)
    assert used == set(range(40)) - set(bad)  # ids stay row indices; the bad rows are out
    assert len(data.val_ids) == 6  # held out among the usable rows
    assert data.dropped["unusable/math"] == 4
    assert data.get(3).answer is None  # never the text 'None'
    assert "row 3: no answer" in caplog.text and "row 29" in caplog.text
    # Whatever is drawn is scored against a real answer: \boxed{None} earns nothing.
    assert score("<think>.</think>\\boxed{None}", "None") == 1.0  # what a bad row used to be
    for i in sorted(used)[:8]:
        assert score("<think>.</think>\\boxed{None}", data.get(i).reference) < 1.0
        assert score(f"<think>.</think>\\boxed{{{2 * i}}}", data.get(i).reference) == 1.0


def test_jsonl_with_unicode_line_separators_inside_strings_loads(tmp_path):
    rows = [{"problem": "Line\u2028separated\x1cproblem", "answer": "1"}] * 2
    path = tmp_path / "u2028.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows))
    data = load_prompt_data(DataConfig(source=str(path), val_size=0))
    assert [p.problem for p in data.prompts] == [rows[0]["problem"]] * 2


def test_a_row_missing_its_answer_key_in_jsonl_is_dropped(tmp_path):
    rows = polaris_rows(10)
    del rows[4]["answer"]  # DeepScaleR-style row without the key: null in the column
    rows[7]["answer"] = float("nan")  # a pandas export's null
    path = tmp_path / "deepscaler.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_prompt_data(DataConfig(source=str(path), val_size=0))
    assert data.train_ids == [0, 1, 2, 3, 5, 6, 8, 9]
    assert data.dropped == {"unusable/math": 2, "too_long/math": 0}


def test_mostly_unusable_rows_or_a_missing_answer_field_is_an_error(tmp_path):
    rows = polaris_rows(8)
    for row in rows[:5]:
        row["answer"] = None
    path = write_jsonl(tmp_path / "broken.jsonl", rows)
    with pytest.raises(ValueError, match=r"broken.jsonl: 5 of 8 rows .*'answer'.*row 0"):
        load_prompt_data(DataConfig(source=str(path), val_size=0))
    renamed = write_jsonl(
        tmp_path / "renamed.jsonl",
        [{"question": "1+1", "final": "2"}, {"question": "2", "final": "2"}],
    )
    with pytest.raises(ValueError, match=r"field 'problem' is not in the dataset .*renamed.jsonl"):
        load_prompt_data(DataConfig(source=str(renamed), val_size=0))


def test_code_rows_without_usable_tests_are_dropped(tmp_path):
    good = json.dumps([{"input": "1\n", "output": "2\n", "testtype": "stdin"}])
    tests = [good] * 7 + ["", "[]", None, "{not json"]
    rows = [{"problem": f"Task {i}.", "tests": t, "metadata": "{}"} for i, t in enumerate(tests)]
    path = write_jsonl(tmp_path / "deepcoder.jsonl", rows)
    data = load_prompt_data(DataConfig(source=str(path), format="deepcoder", val_size=0))
    assert data.train_ids == list(range(7))
    assert data.dropped["unusable/code"] == 4


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.jsonl", b"", r"empty.jsonl: the file is empty"),
        ("blank.jsonl", b"\n  \n", r"blank.jsonl: the file is empty"),
        ("empty.parquet", b"", r"empty.parquet: the file is empty"),
        ("junk.parquet", b"garbage", r"cannot read .*junk.parquet: ArrowInvalid"),
        (
            "latin1.jsonl",
            b'{"problem": "a", "answer": "1"}\n{"problem": "b", "answer": "1"}\n'
            b'{"problem": "caf\xe9", "answer": "1"}\n',
            r"latin1.jsonl line 3: not UTF-8",
        ),
        (
            "latin1.csv",
            b"problem,answer\na,1\ncaf\xe9,2\n",
            r"latin1.csv line 3: not UTF-8",
        ),
        (
            "broken.jsonl",
            b'{"problem": "a", "answer": "1"}\n{"problem": "b", answer: 1}\n',
            r"broken.jsonl line 2: invalid JSON",
        ),
        (
            "list.jsonl",
            b'{"problem": "a", "answer": "1"}\n\n["b", "1"]\n',
            r"list.jsonl line 3: expected a JSON object per line",
        ),
        ("array.json", b'[{"problem": "a",\n "answer": 1},\n]', r"array.json line 3: invalid JSON"),
    ],
)
def test_unreadable_data_files_name_the_file_and_line(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_prompt_data(DataConfig(source=str(tmp_path / name), val_size=0))


def test_over_long_prompts_are_dropped_whatever_max_prompt_tokens_says(tmp_path, caplog):
    """tiny_cpu with data.max_prompt_tokens: 0 and one 20,000-character row: the row is
    dropped and counted at load (it used to reach the warm start, a 327 GB allocation for a
    real long row, or fail the RL step that drew it)."""
    from pathlib import Path

    from megatron_rl.config import load_run_config
    from megatron_rl.config.checks import prompt_token_limit
    from megatron_rl.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(tmp_path / "tok")
    # tiny_cpu: max_model_len 80 (the tightest of 80, micro_batch_tokens 4096 and the 512
    # positions of tiny-llama) less the longest response max(max_tokens 48, 36 + 8) = 32.
    limit = 80 - 48
    rows = polaris_rows(20)
    rows[5]["problem"] = "7" * 20_000
    rows[9]["problem"] = "8" * (limit - 2)  # + newline + BOS: exactly the limit
    rows[12]["problem"] = "9" * (limit - 1)  # one token over
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "tiny_cpu.yaml"
    config = load_run_config(
        recipe, [f"data.source={path}", "data.max_prompt_tokens=0", "data.val_size=4"]
    )
    assert prompt_token_limit(config) == limit
    with caplog.at_level("WARNING"):
        data = load_prompt_data(config.data, tokenizer, max_tokens=prompt_token_limit(config))
    used = set(data.train_ids) | set(data.val_ids)
    assert used == set(range(20)) - {5, 12}
    assert data.dropped["too_long/math"] == 2
    assert "row 5 (20002 tokens)" in caplog.text
    # data.max_prompt_tokens still lowers the limit, never raises it.
    config.data.max_prompt_tokens = 1000
    data = load_prompt_data(config.data, tokenizer, max_tokens=prompt_token_limit(config))
    assert {5, 12}.isdisjoint(data.train_ids + data.val_ids)
    config.data.max_prompt_tokens = 20  # "What is 19 + 19?" is 18 tokens with newline, BOS
    data = load_prompt_data(config.data, tokenizer, max_tokens=prompt_token_limit(config))
    assert 9 not in data.train_ids + data.val_ids and 0 in data.train_ids + data.val_ids


def test_a_mixture_names_rows_within_each_source_and_counts_by_source(tmp_path, caplog):
    from megatron_rl.data import DataSourceConfig
    from megatron_rl.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(tmp_path / "tok")
    first = write_jsonl(tmp_path / "a.jsonl", polaris_rows(10))
    rows = polaris_rows(10)
    rows[0]["answer"] = None
    rows[4]["problem"] = "4" * 40  # 42 tokens with newline and BOS
    second = write_jsonl(tmp_path / "b.jsonl", rows)
    config = DataConfig(
        val_size=2,
        sources=[
            DataSourceConfig(source=str(first), name="a"),
            DataSourceConfig(source=str(second), name="b"),
        ],
    )
    with caplog.at_level("WARNING"):
        data = load_prompt_data(config, tokenizer, max_tokens=32)
    assert data.dropped == {
        "unusable/a": 0,
        "too_long/a": 0,
        "unusable/b": 1,
        "too_long/b": 1,
    }
    assert set(data.train_ids) | set(data.val_ids) == set(range(20)) - {10, 14}
    assert "b.jsonl: dropped 1 of 10 rows that cannot be scored" in caplog.text
    assert "row 0: no answer" in caplog.text and "row 4 (42 tokens)" in caplog.text


@pytest.mark.timeout(600)  # ~30 s on a quiet 2-core machine (model set-up before the data)
def test_train_reports_a_bad_data_file_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    data = tmp_path / "polaris.jsonl"
    data.write_bytes(b'{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "answer": 4,}\n')
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl.cli",
        "train",
        str(root / "recipes" / "tiny_cpu.yaml"),
    ]
    cmd += [f"data.source={data}", "data.val_size=1", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"megatron-rl train: error: {data} line 2: invalid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr

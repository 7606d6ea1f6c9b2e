"""`megatron-rl reward-audit` (issue 37 item 10), end to end on rows of a public file.

The rows are Math-Verify's public test cases as responses (tests/data/math_verify_suite.jsonl,
see tests/data/README.md): their "expected" field is Math-Verify's verdict, the label. Three
of them are changed here so that each disagreement class the command reports is met, with
the class known by construction of the change (not by the reward's own answer).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rl.cli import main

SUITE = Path(__file__).resolve().parents[2] / "data" / "math_verify_suite.jsonl"
PREFIX = "test_all.py::"
# Kept as they are (Math-Verify's verdict: correct, correct, correct, wrong).
AGREE = [
    "test_latex_notation[10]",  # \frac13 against 1/3
    "test_latex_notation[16]",  # 1/3 against 1/3
    "test_latex_notation_math[11]",  # 2 against 2
    "test_complex_math_expressions[12]",  # 1 against 1\sqrt{19}: wrong
]
FLIPPED = "test_latex_notation_math[14]"  # 9 against 9, its label turned to wrong
CUT = "test_latex_notation[13]"  # the response cut before its answer, the label kept
MOVED = "test_latex_notation[14]"  # \dfrac{1}{3}, its reference changed to 1/4


def _suite() -> dict[str, dict]:
    with open(SUITE) as f:
        rows = [json.loads(line) for line in f if line.strip() and not line.startswith("#")]
    return {row["id"]: row for row in rows}


def _slice() -> list[dict]:
    suite = _suite()
    rows = [dict(suite[PREFIX + name]) for name in AGREE + [FLIPPED, CUT, MOVED]]
    flipped, cut, moved = rows[-3:]
    assert flipped["expected"] == cut["expected"] == moved["expected"] == 1
    flipped["expected"] = 0
    cut["response"] = cut["response"].split("</think>")[0]  # thinking that never ends
    moved["reference"] = "$\\frac{1}{4}$"
    return [
        {
            "id": r["id"],
            "response": r["response"],
            "reference": r["reference"],
            "label": r["expected"],
        }
        for r in rows
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(120)
def test_audit_with_labels_prints_agreement_and_writes_the_disagreements(tmp_path, capsys):
    data = _write_jsonl(tmp_path / "evals.jsonl", _slice())
    out = tmp_path / "disagreements.jsonl"
    recipe = SUITE.parents[2] / "recipes" / "tiny_cpu.yaml"  # its reward settings
    argv = ["reward-audit", str(data), "--domain", "math", "--recipe", str(recipe)]
    assert main([*argv, "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"reward settings of {recipe}" in printed
    assert "agreement with labels: 4/7 = 57.1%" in printed, printed
    assert "rewarded where the label says wrong: 1" in printed
    table = {
        line.split()[0]: int(line.split()[1])
        for line in printed.split("disagreements by class:")[1].splitlines()[2:8]
    }
    assert table == {
        "extraction_empty": 1,
        "unequal": 1,
        "rewarded_label_wrong": 1,
        "timeout": 0,
        "crash": 0,
        "bad_reference": 0,
    }
    assert "slowest rows" in printed
    written = [json.loads(line) for line in out.read_text().splitlines()]
    by_class = {row["class"]: row for row in written}
    assert sorted(by_class) == ["extraction_empty", "rewarded_label_wrong", "unequal"]
    # Each names its row (file and line) and says what was read.
    assert by_class["rewarded_label_wrong"]["row"] == f"{data} line 5"
    assert by_class["rewarded_label_wrong"]["id"] == PREFIX + FLIPPED
    assert by_class["extraction_empty"]["row"] == f"{data} line 6"
    assert by_class["extraction_empty"]["extracted"] is None
    assert by_class["unequal"]["row"] == f"{data} line 7"
    assert by_class["unequal"]["extracted"] == "\\dfrac{1}{3}"
    assert by_class["unequal"]["reference_seen"] == "\\frac{1}{4}"


@pytest.mark.timeout(120)
def test_audit_without_labels_shows_what_was_extracted(tmp_path, capsys):
    rows = [{k: v for k, v in r.items() if k != "label"} for r in _slice()]
    data = tmp_path / "evals.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    out = tmp_path / "empty.jsonl"
    assert main(["reward-audit", str(data), "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "agreement" not in printed
    assert "extracted answers (6 distinct)" in printed, printed
    assert "nothing extracted: 1 rows" in printed
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["id"]) for r in written] == [(f"{data} row 6", PREFIX + CUT)]


def test_bad_rows_are_refused_naming_the_row(tmp_path, capsys):
    good = {"response": "</think>\\boxed{1}", "reference": "1"}
    for bad, message in (
        (
            {"response": "</think>\\boxed{None}", "reference": None},
            "line 2: the reference is missing",
        ),
        ({"response": "</think>\\boxed{1}"}, "line 2: the reference is missing"),
        ({**good, "label": "maybe"}, "line 2: label 'maybe' is not a verdict"),
        ({**good, "domain": "geometry"}, "line 2: field 'domain' must be one of"),
        ({"text": "x", "reference": "1"}, "line 2: field 'response' must be the response text"),
    ):
        data = _write_jsonl(tmp_path / "evals.jsonl", [good, bad])
        assert main(["reward-audit", str(data)]) == 2
        assert message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_audit_of_code_rows(tmp_path, capsys):
    from megatron_rl.rewards import RewardConfig
    from megatron_rl.rewards.isolation import SandboxUnavailableError, box_for

    try:
        box_for(RewardConfig(kind="code"))
    except SandboxUnavailableError as exc:
        pytest.skip(f"no code sandbox on this machine: {exc}")
    tests = [{"input": "3 4\n", "output": "7\n"}]
    fence = "```python\n{}```"
    rows = [
        {
            "response": "</think>" + fence.format("print(sum(map(int, input().split())))\n"),
            "label": 1,
        },
        {"response": "</think>" + fence.format("print(0)\n"), "label": True},
        {"response": "</think>no program", "label": "incorrect"},
    ]
    data = _write_jsonl(tmp_path / "code.jsonl", [{**r, "reference": tests} for r in rows])
    out = tmp_path / "code_disagreements.jsonl"
    assert main(["reward-audit", str(data), "--domain", "code", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "agreement with labels: 2/3 = 66.7%" in printed, printed
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["class"], r["status"]) for r in written] == [
        (f"{data} line 2", "unequal", "wrong")
    ]


TORA = Path(__file__).resolve().parents[2] / "data" / "tora_gsm8k_outputs_slice.jsonl"


@pytest.mark.timeout(120)
def test_audit_of_public_model_outputs_against_their_harness(tmp_path, capsys):
    """Real model outputs nobody here wrote: ToRA-70B's and ToRA-Code-34B's released GSM8K
    outputs, labelled with ToRA's own verdicts (tools/build_tora_audit_file.py checks they
    reproduce its published scores). A response with a boxed answer must agree with the
    label; one without (ToRA reads the program's printed output instead) is -1 here by
    design, and must be reported as extraction_empty; nothing labelled wrong is rewarded."""
    rows = [json.loads(x) for x in TORA.read_text().splitlines() if not x.startswith("#")]
    boxed = [("\\boxed{" in r["response"]) for r in rows]
    out = tmp_path / "dis.jsonl"
    argv = ["reward-audit", str(TORA), "reward.require_think_end=false", "--workers", "1"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    disagreements = [json.loads(x) for x in out.read_text().splitlines()]
    lines = {int(d["row"].rsplit(" ", 1)[1]) for d in disagreements}
    # Row i of the file (0-based, after the header line) is line i + 2.
    expected = {
        i + 2
        for i, (row, has_box) in enumerate(zip(rows, boxed, strict=True))
        if row["label"] and not has_box
    }
    # Boxed answers on these GSM8K rows are integers or decimals that equal the reference
    # exactly when ToRA says correct, except ToRA's x100 tolerance (none in this slice).
    assert lines == expected and expected, (lines, expected)
    assert all(d["class"] == "extraction_empty" for d in disagreements)
    agree = len(rows) - len(expected)
    assert f"agreement with labels: {agree}/{len(rows)} = " in printed
    assert "rewarded where the label says wrong: 0" in printed


def test_overrides_outside_the_reward_section_are_refused(capsys):
    assert main(["reward-audit", str(TORA), "model.preset=tiny-llama"]) == 2
    assert "reward.* keys only" in capsys.readouterr().err
    assert main(["reward-audit", str(TORA), "reward.no_such_key=1"]) == 2
    assert "reward.no_such_key" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_the_summary_names_a_missing_think_end_and_counts_the_rewarded_rows(tmp_path, capsys):
    """Issue 45, 4: outputs of a model that writes no thinking block extract nothing with
    the default settings; the summary says why and which setting changes it. Issue 47: it
    says how many rows were rewarded."""
    rows = [
        {"response": "So $\\boxed{6}$.", "reference": "6", "label": 1},
        {"response": "The answer is $\\frac{1}{2}$.", "reference": "0.5", "label": 1},
        {"response": "So $\\boxed{7}$.", "reference": "8", "label": 0},
        {"response": "<think>x</think>So $\\boxed{3}$.", "reference": "3", "label": 1},
    ]
    data = _write_jsonl(tmp_path / "evals.jsonl", rows)
    assert main(["reward-audit", str(data), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "rewarded: 1 of 4 rows" in printed
    assert "no answer read in 3 of 4 rows because they have no '</think>'" in printed
    assert "reward.require_think_end=false" in printed
    assert "agreement with labels: 2/4 = 50.0%" in printed
    argv = ["reward-audit", str(data), "reward.require_think_end=false", "--workers", "1"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rewarded: 3 of 4 rows" in printed
    assert "no answer read" not in printed
    assert "agreement with labels: 4/4 = 100.0%" in printed


@pytest.mark.timeout(120)
def test_out_defaults_to_beside_the_input_and_is_checked_before_scoring(
    tmp_path, capsys, monkeypatch
):
    data = _write_jsonl(tmp_path / "evals.jsonl", [{"response": "x", "reference": "1"}])
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["reward-audit", str(data), "--workers", "1"]) == 0
    assert (tmp_path / "evals.jsonl.disagreements.jsonl").is_file()
    assert list(elsewhere.iterdir()) == []
    capsys.readouterr()
    for out in (tmp_path / "no_such_dir" / "out.jsonl", tmp_path):  # missing dir; a directory
        assert main(["reward-audit", str(data), "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert f"--out {out}: cannot write the disagreements there" in captured.err
        assert "scoring" not in captured.err  # refused before any row was scored


@pytest.mark.parametrize(
    "content, line",
    [
        (b'{"response": "x", "reference": "1"}\n{"response": "caf\xe9", "reference": "1"}\n', 2),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", 1),
    ],
    ids=["latin-1", "binary"],
)
def test_a_file_that_is_not_utf8_is_refused_naming_file_and_line(tmp_path, capsys, content, line):
    data = tmp_path / "evals.jsonl"
    data.write_bytes(content)
    assert main(["reward-audit", str(data)]) == 2
    assert f"{data} line {line}: not UTF-8 text" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_code_tests_of_no_known_shape_are_a_bad_reference_not_a_traceback(tmp_path, capsys):
    # Issue 49, 9: {"inputs": 1, "outputs": 2} ended the audit in a TypeError after scoring.
    fence = "</think>```python\nprint(1)\n```"
    rows = [
        {"response": fence, "reference": {"inputs": 1, "outputs": 2}, "label": 1},
        {"response": fence, "reference": {"inputs": [[1]], "outputs": None}, "label": 0},
    ]
    data = _write_jsonl(tmp_path / "code.jsonl", rows)
    out = tmp_path / "out.jsonl"
    assert main(["reward-audit", str(data), "--domain", "code", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "statuses: bad_tests 2" in printed
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["row"], r["class"]) for r in written] == [(f"{data} line 1", "bad_reference")]

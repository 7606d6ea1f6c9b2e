"""Reading runs from metrics.jsonl / CSV, filtering, configuration, and every error path."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from megatron_rl.scaling import CurveParams, FitConfig, fit_points, fit_run, load_run, synthetic_run
from megatron_rl.scaling.analysis import select_points


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_skips_records_without_the_metric(tmp_path):
    records = [
        {"step": 0, "gpu_hours": 0.0, "val_pass_rate": 0.3},
        {"step": 10, "gpu_hours": 5.0, "loss": 1.0},  # training record: skipped
        {"step": 20, "gpu_hours": 10.0, "val_pass_rate": None},  # skipped too
        {"step": 100, "gpu_hours": 50.0, "val_pass_rate": 0.4, "other": 0.9},
    ]
    run = load_run(write_jsonl(tmp_path / "my_run" / "metrics.jsonl", records))
    assert run.name == "my_run"
    np.testing.assert_array_equal(run.x, [0.0, 50.0])
    np.testing.assert_array_equal(run.y, [0.3, 0.4])
    assert run.default_r0() == 0.3
    other = load_run(tmp_path / "my_run" / "metrics.jsonl", "step", "other", name="o")
    assert other.name == "o" and list(other.x) == [100] and list(other.y) == [0.9]


def test_csv_with_chosen_columns(tmp_path):
    path = tmp_path / "curve.csv"
    path.write_text("step,hours,score\n0,0,0.25\n100,10.5,\n200,21,0.5\n")
    run = load_run(path, "hours", "score")
    assert run.name == "curve"
    np.testing.assert_array_equal(run.x, [0.0, 21.0])
    np.testing.assert_array_equal(run.y, [0.25, 0.5])


@pytest.mark.parametrize(
    "records, message",
    [
        ([{"gpu_hours": 1.0, "loss": 2.0}], "no record has field 'val_pass_rate'"),
        (
            [{"step": 3, "val_pass_rate": 0.5}],
            "line 1: record has 'val_pass_rate' but no 'gpu_hours'",
        ),
        ([{"gpu_hours": 1.0, "val_pass_rate": math.nan}], "line 1: val_pass_rate is NaN"),
        ([{"gpu_hours": math.nan, "val_pass_rate": 0.1}], "line 1: gpu_hours is NaN"),
        ([{"gpu_hours": math.inf, "val_pass_rate": 0.1}], "gpu_hours is infinite"),
        ([{"gpu_hours": 1.0, "val_pass_rate": "high"}], "val_pass_rate must be a number"),
        ([{"gpu_hours": 1.0, "val_pass_rate": True}], "val_pass_rate must be a number"),
        ([{"gpu_hours": -1.0, "val_pass_rate": 0.1}], "gpu_hours must be >= 0"),
        (
            [{"gpu_hours": 5.0, "val_pass_rate": 0.1}, {"gpu_hours": 4.0, "val_pass_rate": 0.2}],
            "line 2: gpu_hours is not monotone (4.0 after 5.0 on line 1)",
        ),
        ([[1, 2]], "line 1: expected a JSON object"),
        (
            [{"gpu_hours": 0.0, "val_pass_rate": 0.1}, {"gpu_hours": 1.0, "val_pass_rate": 1.02}],
            "line 2: val_pass_rate = 1.02 is not a pass rate in [0, 1]",
        ),
        ([{"gpu_hours": 0.0, "val_pass_rate": -0.5}], "line 1: val_pass_rate = -0.5 is not a"),
    ],
)
def test_jsonl_errors_name_file_line_and_field(tmp_path, records, message):
    path = write_jsonl(tmp_path / "metrics.jsonl", records)
    with pytest.raises(ValueError) as err:
        load_run(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_invalid_json_and_missing_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"gpu_hours": 1, "val_pass_rate": 0.5}\n{"gpu_hours": 2,\n')
    with pytest.raises(ValueError, match="line 2: invalid JSON"):
        load_run(path)
    with pytest.raises(ValueError, match="no such file"):
        load_run(tmp_path / "absent.jsonl")


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "gpu_hours,reward\n1,0.2\n",
            "missing column 'val_pass_rate' (columns: gpu_hours, reward)",
        ),
        ("hours,val_pass_rate\n1,0.2\n", "missing column 'gpu_hours'"),
        ("gpu_hours,val_pass_rate\n1,nan\n", "line 2: val_pass_rate is NaN"),
        (
            "gpu_hours,val_pass_rate\n1,0.1\n,0.2\n",
            "line 3: row has 'val_pass_rate' but no 'gpu_hours'",
        ),
        ("gpu_hours,val_pass_rate\n1,abc\n", "line 2: val_pass_rate must be a number"),
        ("gpu_hours,val_pass_rate\n2,0.1\n1,0.2\n", "gpu_hours is not monotone"),
        ("gpu_hours,val_pass_rate\n1,\n", "no record has field 'val_pass_rate'"),
    ],
)
def test_csv_errors(tmp_path, text, message):
    path = tmp_path / "run.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_run(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_point_selection_min_x_fit_until_and_zero():
    run = synthetic_run(CurveParams(0.6, 2.0, 2500.0, 0.3), 10_000, 1000, eval_every=100)
    # x = 0, 1000, ..., 10000
    assert list(run.x[select_points(run, FitConfig(min_x=1500))]) == list(np.arange(2, 11) * 1000.0)
    mask = select_points(run, FitConfig(min_x=0, fit_until=5000))
    assert list(run.x[mask]) == [1000.0, 2000.0, 3000.0, 4000.0, 5000.0]  # x = 0 never fitted


def test_too_few_points_after_filtering_names_the_run():
    run = synthetic_run(CurveParams(0.6, 2.0, 2500.0, 0.3), 1.0, 100, eval_every=10)
    with pytest.raises(ValueError) as err:
        fit_run(run, FitConfig())  # every x < 1500 GPU-hours
    text = str(err.value)
    assert "too few points after filtering: 0 of 11" in text and run.source in text
    assert "--min-x" in text
    long_run = synthetic_run(CurveParams(0.6, 2.0, 2500.0, 0.3), 20_000, 2000)
    with pytest.raises(ValueError, match="too few points after filtering: 4 of 21"):
        fit_run(long_run, FitConfig(fit_until=5000))


def test_fit_points_rejects_nan_and_too_few():
    x = np.linspace(2000, 9000, 8)
    y = np.full(8, 0.5)
    y[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        fit_points(x, y, 0.3, FitConfig())
    with pytest.raises(ValueError, match="too few points"):
        fit_points(x[:4], np.full(4, 0.5), 0.3, FitConfig())
    with pytest.raises(ValueError, match="NaN"):
        fit_points(x, np.full(8, 0.5), math.nan, FitConfig())


def test_auto_a_range_needs_a_rising_curve():
    x = np.linspace(2000, 9000, 8)
    with pytest.raises(ValueError, match="no fitted y exceeds R0"):
        fit_points(x, np.full(8, 0.2), 0.3, FitConfig(a_range="auto"))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"a_range": (0.8, 0.4)}, "a_range"),
        ({"a_range": "wide"}, "a_range"),
        ({"c_mid_range": (0.0, 10.0)}, "c_mid_range"),
        ({"b_range": "auto"}, "b_range"),
        ({"a_step": 0.0}, "a_step"),
        ({"c_mid_num": 0}, "c_mid_num"),
        ({"c_mid_spacing": "cubic"}, "c_mid_spacing"),
        ({"min_points": 2}, "min_points"),
        ({"bootstrap": -1}, "bootstrap"),
        ({"ci": 1.5}, "ci"),
        ({"fix_a": math.nan}, "fix_a"),
        ({"min_x": 100.0, "fit_until": 50.0}, "fit_until"),
        ({"a_tolerance": -0.1}, "a_tolerance"),
        ({"y_field": ""}, "y_field"),
    ],
)
def test_config_validate_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        FitConfig(**change).validate()


def test_default_config_is_the_papers_grid():
    config = FitConfig().validate()
    assert config.a_range == (0.45, 0.80) and config.a_step == 0.005
    assert config.c_mid_range == (100.0, 40000.0) and config.c_mid_num == 100
    assert config.min_x == 1500.0 and config.a_tolerance == 0.02


def test_only_pass_rate_fields_are_held_to_zero_one(tmp_path):
    records = [
        {"gpu_hours": 0.0, "reward_mean": -0.4, "val_pass_rate/math": 0.2},
        {"gpu_hours": 1.0, "reward_mean": 1.5, "val_pass_rate/math": 1.5},
    ]
    path = write_jsonl(tmp_path / "metrics.jsonl", records)
    assert list(load_run(path, y_field="reward_mean").y) == [-0.4, 1.5]  # not a rate
    with pytest.raises(ValueError, match=r"line 2: val_pass_rate/math = 1.5 is not a pass rate"):
        load_run(path, y_field="val_pass_rate/math")
    csv_path = tmp_path / "percent.csv"
    csv_path.write_text("gpu_hours,pass_rate\n0,20\n")
    with pytest.raises(ValueError, match=r"percent.csv line 2: pass_rate = 20 is not a pass rate"):
        load_run(csv_path, y_field="pass_rate")

"""`megatron-rl fit`: table, JSON, plots, error exits, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.cli import main
from megatron_rl.scaling import CurveParams, FitConfig, fit_run, load_run, synthetic_run

REPO = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(directory: Path, params: CurveParams, seed: int) -> Path:
    """A metrics.jsonl as the trainer writes it: a record every 10 steps, an evaluation
    (val_pass_rate) every 100 steps; 7,400 steps over 100k GPU-hours."""
    run = synthetic_run(params, 100_000, 7400, eval_every=100, noise_sd=0.01, seed=seed)
    lines = []
    for step in range(0, 7401, 10):
        record = {"step": step, "gpu_hours": step * 100_000 / 7400, "loss": 0.1}
        if step % 100 == 0:
            record["val_pass_rate"] = float(run.y[step // 100])
        lines.append(json.dumps(record))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "metrics.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    return [
        write_metrics(root / "scalerl", CurveParams(0.610, 1.92, 2542.0, 0.35), seed=0),
        write_metrics(root / "batch_512", CurveParams(0.605, 1.40, 2818.0, 0.35), seed=1),
    ]


def test_table_for_two_runs(runs, capsys):
    assert main(["fit", str(runs[0]), str(runs[1]), "--extrapolate-to", "200000"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "R(200000)" in out
    assert "scalerl" in out and "batch_512" in out
    assert "refitted with A fixed at their mean" in out
    assert "ranking: scalerl > batch_512" in out


def test_json_matches_the_library_and_the_formula(runs, capsys):
    argv = ["fit", str(runs[0]), "--fit-until", "50000", "--extrapolate-to", "100000", "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert "comparison" not in summary  # one run
    (entry,) = summary["runs"]
    fit = entry["fit"]
    assert entry["name"] == "scalerl" and entry["n_records"] == 75
    expected = fit_run(load_run(runs[0]), FitConfig(fit_until=50_000)).fit
    assert fit["A"] == pytest.approx(expected.params.a)
    assert fit["B"] == pytest.approx(expected.params.b)
    assert fit["C_mid"] == pytest.approx(expected.params.c_mid)
    assert fit["n_points"] == 36  # x = 2702.7 .. 50000 every 1351.35 GPU-hours
    assert fit["R0"] == pytest.approx(load_run(runs[0]).y[0])
    assert fit["residual"] == pytest.approx(fit["rmse"] ** 2 * fit["n_points"])
    want = fit["R0"] + (fit["A"] - fit["R0"]) / (1 + (fit["C_mid"] / 100_000) ** fit["B"])
    assert fit["prediction"] == pytest.approx(want)
    assert fit["intervals"] is None and fit["prediction_interval"] is None
    assert fit["fit_x_range"][1] <= 50_000
    assert fit["search_box"]["A"] == pytest.approx([0.45, 0.80])
    assert fit["search_box"]["C_mid"] == pytest.approx([100, 40_000])


def test_json_comparison_and_intervals(runs, capsys):
    argv = ["fit", *map(str, runs), "--json", "--bootstrap", "20", "--extrapolate-to", "1e5"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    comparison = summary["comparison"]
    assert comparison["rule"] == "fixed_a" and comparison["ranking"] == ["scalerl", "batch_512"]
    assert all(r["A"] == comparison["a_common"] and r["a_fixed"] for r in comparison["refits"])
    for entry in summary["runs"]:
        fit = entry["fit"]
        for key in ("A", "B", "C_mid"):
            low, high = fit["intervals"][key]
            assert low <= high
        low, high = fit["prediction_interval"]
        assert low <= high and fit["bootstrap"]["resamples"] == 20


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plots_are_written(runs, tmp_path):
    linear = tmp_path / "plots" / "linear.png"
    logx = tmp_path / "logx.png"
    base = ["fit", *map(str, runs), "--fit-until", "50000", "--extrapolate-to", "150000"]
    assert main([*base, "--bootstrap", "20", "--plot", str(linear)]) == 0
    assert main([*base, "--logx", "--plot", str(logx)]) == 0
    assert png_size(linear) == png_size(logx) == (1080, 720)
    assert linear.stat().st_size > 20_000
    assert linear.read_bytes() != logx.read_bytes()


def test_small_run_with_auto_grid(tmp_path, capsys):
    """A CPU-scale run: GPU-hours ~1e-3 and pass rates up to 0.9."""
    path = tmp_path / "tiny.csv"
    run = synthetic_run(CurveParams(0.9, 1.5, 3e-4, 0.1), 2e-3, 400, eval_every=10, seed=0)
    path.write_text(
        "gpu_hours,val_pass_rate\n" + "".join(f"{x},{y}\n" for x, y in zip(run.x, run.y))
    )
    argv = ["fit", str(path), "--min-x", "0", "--auto-grid", "--json"]
    assert main(argv) == 0
    fit = json.loads(capsys.readouterr().out)["runs"][0]["fit"]
    assert abs(fit["A"] - 0.9) < 0.02 and fit["at_bound"] == []


def bad_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.jsonl"
    records = {
        "missing_field": [{"gpu_hours": 1.0, "reward": 0.1}],
        "nan": [{"gpu_hours": 1.0, "val_pass_rate": float("nan")}],
        "non_monotone": [
            {"gpu_hours": 2000.0, "val_pass_rate": 0.1},
            {"gpu_hours": 1000.0, "val_pass_rate": 0.2},
        ],
        "too_few": [{"gpu_hours": float(x), "val_pass_rate": 0.3} for x in range(0, 3000, 500)],
        "above_one": [  # a percentage where a fraction belongs
            {"gpu_hours": 0.0, "val_pass_rate": 0.2},
            {"gpu_hours": 2000.0, "val_pass_rate": 45.0},
        ],
    }[kind]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "kind, message",
    [
        ("missing_field", "no record has field 'val_pass_rate'"),
        ("nan", "val_pass_rate is NaN"),
        ("non_monotone", "gpu_hours is not monotone"),
        ("too_few", "too few points after filtering: 3 of 6"),
        ("above_one", "line 2: val_pass_rate = 45 is not a pass rate in [0, 1]"),
    ],
)
def test_bad_input_exits_2_with_the_message(tmp_path, capsys, kind, message):
    path = bad_file(tmp_path, kind)
    assert main(["fit", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and "Traceback" not in err


def test_option_errors_exit_2(runs, capsys, tmp_path):
    assert main(["fit", str(runs[0]), "--label", "a", "--label", "b"]) == 2
    assert "--label given 2 times for 1 files" in capsys.readouterr().err
    assert main(["fit", str(runs[0]), "--a-range", "0.8,0.4"]) == 2
    assert "a_range" in capsys.readouterr().err
    assert main(["fit", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["fit", str(runs[0]), "--plot", str(blocker / "p.png")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", str(runs[0]), "--a-range", "wide"])
    assert exit_info.value.code == 2
    assert "expected LOW,HIGH or 'auto'" in capsys.readouterr().err


def test_cli_process_reports_errors_without_traceback_and_never_imports_torch(runs, tmp_path):
    bad = bad_file(tmp_path, "nan")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl.cli", "fit", str(bad)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "val_pass_rate is NaN" in proc.stderr and "Traceback" not in proc.stderr
    plot = tmp_path / "p.png"
    code = (
        "import sys\n"
        "import megatron_rl.scaling\n"
        "from megatron_rl.cli import main\n"
        f"rc = main(['fit', {str(runs[0])!r}, '--bootstrap', '5', '--plot', {str(plot)!r}])\n"
        "assert rc == 0, rc\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'))\n"
        "assert not heavy, heavy\n"
        "print('clean')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert "clean" in proc.stdout and plot.exists()


def test_fit_one_domain_of_a_joint_run(tmp_path, capsys):
    """One metrics file with per-domain validation (``val_pass_rate/<domain>``), as a
    math+code run writes it: ``--y val_pass_rate/code`` fits the code curve alone."""
    curves = {
        "math": CurveParams(0.595, 2.05, 2896.0, 0.30),  # Table 1, math+code row
        "code": CurveParams(0.615, 1.09, 1675.0, 0.20),
    }
    points = {
        d: synthetic_run(p, 100_000, 7400, eval_every=100, noise_sd=0.0, seed=0)
        for d, p in curves.items()
    }
    lines = []
    for k, x in enumerate(points["math"].x):
        ys = {f"val_pass_rate/{d}": float(points[d].y[k]) for d in curves}
        lines.append(json.dumps({"step": k * 100, "gpu_hours": float(x), **ys}))
    path = tmp_path / "joint" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    fits = {}
    for domain in curves:
        assert main(["fit", str(path), "--y", f"val_pass_rate/{domain}", "--json"]) == 0
        (entry,) = json.loads(capsys.readouterr().out)["runs"]
        fits[domain] = entry["fit"]
    for domain, params in curves.items():
        assert fits[domain]["A"] == pytest.approx(params.a, abs=0.006)
        assert fits[domain]["B"] == pytest.approx(params.b, rel=0.1)
    assert main(["fit", str(path), "--y", "val_pass_rate/science"]) == 2
    assert "val_pass_rate/code" in capsys.readouterr().err  # the fields it has


def test_the_runs_own_next_command_works_on_a_cpu_run(tmp_path, capsys):
    """The end-of-run block suggests `megatron-rl fit RUN/metrics.jsonl --plot RUN/fit.png`;
    on a CPU run (GPU-hours ~1e-3, none past the paper's 1.5k cutoff) it exited 2 with
    '0 of N records have gpu_hours >= 1500'. Without range options fit now takes the range
    from the data and says so; the file's torn last line (a run writing it) is skipped."""
    run = synthetic_run(CurveParams(0.9, 1.5, 3e-4, 0.1), 2e-3, 400, eval_every=10, seed=0)
    lines = [json.dumps({"step": 0, "gpu_hours": 0.0, "reward_mean": 0.0})]
    lines += [
        json.dumps({"step": i * 10, "gpu_hours": float(x), "val_pass_rate": float(y)})
        for i, (x, y) in enumerate(zip(run.x, run.y))
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + '\n{"step": 400, "gpu_hou')  # torn last line
    plot = tmp_path / "fit.png"
    assert main(["fit", str(path), "--plot", str(plot), "--json"]) == 0
    out, err = capsys.readouterr()
    assert "as --min-x 0 --auto-grid" in err and "largest here is 0.002" in err
    fit = json.loads(out)["runs"][0]["fit"]
    assert abs(fit["A"] - 0.9) < 0.02
    assert plot.read_bytes().startswith(PNG_MAGIC)
    # An explicit --min-x keeps its meaning (no silent change of the user's range) ...
    assert main(["fit", str(path), "--min-x", "1500"]) == 2
    assert "have gpu_hours >= 1500" in capsys.readouterr().err
    # ... and the message states the filter x > 0 as it is, not ">= 0".
    few = tmp_path / "few.jsonl"
    few.write_text(
        "".join(
            json.dumps({"gpu_hours": x, "val_pass_rate": 0.3}) + "\n" for x in (0.0, 1e-3, 2e-3)
        )
    )
    assert main(["fit", str(few), "--min-x", "0"]) == 2
    assert "2 of 3 records with 'val_pass_rate' have gpu_hours > 0" in capsys.readouterr().err


def test_a_torn_line_inside_the_file_is_still_an_error(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"gpu_hours": 0, "val_pass_rate": 0.1}\n{"gpu_ho\n{"gpu_hours": 1}\n')
    assert main(["fit", str(path)]) == 2
    assert f"{path} line 2: invalid JSON" in capsys.readouterr().err

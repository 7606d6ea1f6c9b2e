"""`megatron-rl fit --holdout`: the paper's hold-out test on synthetic runs drawn from known
curves (overall and per domain) and on a real tiny CPU run's validations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.cli import main
from megatron_rl.scaling import CurveParams

DATA = Path(__file__).resolve().parents[2] / "data"
# Two domains with known curves; the overall pass rate is their mean (equal prompt counts).
MATH = CurveParams(a=0.70, b=1.6, c_mid=20_000.0, r0=0.30)
CODE = CurveParams(a=0.55, b=2.2, c_mid=35_000.0, r0=0.20)


def sigmoid(p: CurveParams, x: np.ndarray) -> np.ndarray:
    """R(C) of the paper, written out here (float64), not taken from the package."""
    return p.r0 + (p.a - p.r0) / (1.0 + (p.c_mid / x) ** p.b)


def joint_run(tmp_path: Path, noise: float = 0.004) -> tuple[Path, np.ndarray, dict]:
    """A joint math + code run over 100k GPU-hours, a validation every 2.5k."""
    x = np.arange(0, 100_001, 2_500, dtype=np.float64)
    rng = np.random.default_rng(0)
    with np.errstate(divide="ignore"):
        truth = {
            "math": np.where(x > 0, sigmoid(MATH, np.maximum(x, 1e-9)), MATH.r0),
            "code": np.where(x > 0, sigmoid(CODE, np.maximum(x, 1e-9)), CODE.r0),
        }
    ys = {d: t + rng.normal(0.0, noise, x.shape) for d, t in truth.items()}
    lines = []
    for k, gpu_hours in enumerate(x):
        lines.append(json.dumps({"step": 10 * k, "gpu_hours": gpu_hours, "loss": 0.1}))
        record = {"step": 10 * k, "gpu_hours": gpu_hours}
        record["val_pass_rate"] = (ys["math"][k] + ys["code"][k]) / 2
        record.update({f"val_pass_rate/{d}": ys[d][k] for d in ys})
        lines.append(json.dumps(record))
    path = tmp_path / "joint" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    return path, x, ys


def test_holdout_predicts_the_second_half_per_domain(tmp_path, capsys):
    path, x, ys = joint_run(tmp_path)
    argv = ["fit", str(path), "--holdout", "0.5", "--bootstrap", "40", "--json"]
    assert main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out)
    held = x > 50_000
    for domain, params in (("math", MATH), ("code", CODE)):
        r = result["domains"][domain]
        assert r["field"] == f"val_pass_rate/{domain}"
        assert r["cut"] == pytest.approx(50_000.0) and r["x_end"] == 100_000.0
        # the paper's filter: points from 1.5k GPU-hours up to the cut are fitted
        assert r["n_fitted"] == int(((x >= 1500) & (x <= 50_000)).sum())
        points = r["points"]
        assert [p["x"] for p in points] == x[held].tolist()
        assert [p["measured"] for p in points] == pytest.approx(ys[domain][held].tolist())
        # each prediction is the fitted curve there (the formula written out above) ...
        fit = CurveParams(r["fit"]["A"], r["fit"]["B"], r["fit"]["C_mid"], r["fit"]["R0"])
        predicted = sigmoid(fit, x[held])
        assert [p["predicted"] for p in points] == pytest.approx(predicted.tolist())
        errors = predicted - ys[domain][held]
        assert r["final_error"] == pytest.approx(errors[-1])
        assert r["mean_abs_error"] == pytest.approx(np.abs(errors).mean())
        assert r["max_abs_error"] == pytest.approx(np.abs(errors).max())
        # ... and from half the compute it lands near the true curve at the end
        assert abs(r["prediction_at_end"] - sigmoid(params, np.array([1e5]))[0]) < 0.03
        low, high = r["prediction_at_end_interval"]
        assert low <= r["prediction_at_end"] <= high
        inside = [p["band"][0] <= p["measured"] <= p["band"][1] for p in points]
        assert r["coverage"] == pytest.approx(np.mean(inside))
    assert result["overall"]["field"] == "val_pass_rate"


def test_holdout_table_names_each_domain(tmp_path, capsys):
    path, _, _ = joint_run(tmp_path)
    png = tmp_path / "holdout.png"
    argv = ["fit", str(path), "--holdout", "0.5", "--bootstrap", "10", "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fitted on gpu_hours <= 50000 (50% of 1e+05)" in out
    rows = {line.split()[0] for line in out.splitlines()[2:]}
    assert {"all", "math", "code"} <= rows
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--holdout", "1.5"], "--holdout must be a fraction in (0, 1), got 1.5"),
        (["--holdout", "0.5", "--fit-until", "9000"], "drop --fit-until"),
        (["--holdout", "0.9"], "too few points after filtering"),
    ],
)
def test_holdout_refuses_bad_requests(tmp_path, capsys, extra, message):
    path, _, _ = joint_run(tmp_path)
    assert main(["fit", str(path), *extra]) == 2
    assert message in capsys.readouterr().err


def test_holdout_on_a_real_tiny_cpu_run(capsys):
    """The validations of a real run of recipes/tiny_cpu.yaml (tests/data; its README says
    how it was made): the held-out errors are those of the fit against the file's values."""
    path = DATA / "tiny_cpu_validations.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    points = [(r["gpu_hours"], r["val_pass_rate"]) for r in records if "val_pass_rate" in r]
    argv = ["fit", str(path), "--holdout", "0.5", "--min-x", "0", "--auto-grid"]
    assert main([*argv, "--bootstrap", "30", "--json"]) == 0
    (result,) = json.loads(capsys.readouterr().out)
    r = result["overall"]
    x_end = max(x for x, _ in points)
    held = [(x, y) for x, y in points if x > x_end / 2]
    assert [p["x"] for p in r["points"]] == [x for x, _ in held]
    assert [p["measured"] for p in r["points"]] == [y for _, y in held]
    fit = CurveParams(r["fit"]["A"], r["fit"]["B"], r["fit"]["C_mid"], r["fit"]["R0"])
    predicted = sigmoid(fit, np.array([x for x, _ in held]))
    assert r["final_error"] == pytest.approx(predicted[-1] - held[-1][1])
    # the run's R0 is its step-0 validation (the fit's default)
    assert fit.r0 == pytest.approx(points[0][1])

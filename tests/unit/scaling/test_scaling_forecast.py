"""The live forecast: predictive power on the paper's Table-1 curves, its metrics fields,
the background worker that never blocks, the plot, and `megatron-rl fit --watch`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_rl.cli import main
from megatron_rl.scaling import CurveParams, synthetic_run
from megatron_rl.scaling.data import RunData, load_run
from megatron_rl.scaling.forecast import ForecastConfig, forecast_run, resolve_budget
from megatron_rl.scaling.table1 import TABLE1, half_budget_check, noisy_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("row", TABLE1, ids=[r.name for r in TABLE1])
def test_forecast_at_half_budget_predicts_the_final_pass_rate(row):
    """Every Table-1 row, three noise draws (sd 0.015, a point every 100 steps): the forecast
    from the points up to half the budget lands within 0.02 of R(budget)."""
    for seed in range(3):
        check = half_budget_check(row, seed, noise_sd=0.015)
        assert abs(check.error) < 0.02, (row.name, seed, check.predicted, check.actual)


def test_half_budget_forecast_uses_only_the_first_half():
    """A run whose second half collapses cannot be seen by a forecast made at half budget:
    its prediction equals that of the clean run (and differs from a fit of everything)."""
    row = TABLE1[0]
    run = noisy_run(row, seed=0)
    y = run.y.copy()
    y[run.x > row.budget / 2] -= 0.2
    broken = RunData("b", "b", "gpu_hours", "val_pass_rate", run.x, y)
    clean = half_budget_check(row, seed=0)
    half = run.x <= row.budget / 2
    seen = RunData("b", "b", "gpu_hours", "val_pass_rate", run.x[half], y[half])
    config = ForecastConfig(bootstrap=0)
    assert forecast_run(seen, config, row.budget).pass_rate_at_budget == pytest.approx(
        clean.predicted
    )
    full = forecast_run(broken, config, row.budget).pass_rate_at_budget
    assert abs(full - clean.predicted) > 0.05


def test_forecast_record_has_every_field_with_its_interval():
    row = TABLE1[0]
    run = noisy_run(row, seed=1)
    forecast = forecast_run(run, ForecastConfig(bootstrap=30), row.budget)
    rec = forecast.record()
    for name in ("A", "B", "C_mid", "pass_rate_at_budget"):
        value, low, high = (
            rec[f"forecast_{name}"],
            rec[f"forecast_{name}_lo"],
            rec[f"forecast_{name}_hi"],
        )
        assert low <= value <= high, (name, low, value, high)
    p = row.params()
    assert rec["forecast_A_lo"] - 0.02 <= p.a <= rec["forecast_A_hi"] + 0.02
    # the prediction at the budget is the fitted curve there (formula, by hand)
    a, b, c, r0 = (rec[k] for k in ("forecast_A", "forecast_B", "forecast_C_mid", "forecast_R0"))
    assert rec["forecast_pass_rate_at_budget"] == pytest.approx(
        r0 + (a - r0) / (1 + (c / row.budget) ** b)
    )
    assert rec["forecast_budget_gpu_hours"] == row.budget
    assert rec["forecast_points"] == int(np.sum(run.x >= 1500))
    json.dumps(rec)  # metrics-ready
    assert "R(100000)" in forecast.summary_line()


def test_budget_is_the_recipe_s_or_the_projection_to_max_steps():
    cfg = ForecastConfig()
    assert resolve_budget(cfg, 16_000.0, 7400, 100, 200.0) == 16_000.0
    assert resolve_budget(ForecastConfig(budget_gpu_hours=5.0), 16_000.0, 7400, 1, 1.0) == 5.0
    assert resolve_budget(cfg, None, 120, 30, 0.003) == pytest.approx(0.012)
    assert resolve_budget(cfg, None, 120, 0, 0.0) is None
    with pytest.raises(ValueError, match="grid"):
        ForecastConfig(grid="wide").validate()
    with pytest.raises(ValueError, match="budget_gpu_hours"):
        ForecastConfig(budget_gpu_hours=-1.0).validate()


def write_run(run_dir: Path, n_evals: int, finished: bool = False, **forecast) -> Path:
    """A CPU-scale run directory as the trainer writes it: config.yaml and metrics.jsonl with
    a step record every step and a validation every 10 steps (~1e-4 GPU-hours per step)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    section = {"min_gpu_hours": 0, "grid": "auto", "bootstrap": 20, **forecast}
    config = {"forecast": section, "training": {"max_steps": 400, "max_gpu_hours": None}}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    truth = synthetic_run(CurveParams(0.8, 1.5, 0.01, 0.2), 0.04, 400, 10, 0.01, seed=3)
    lines = []
    for step in range(0, 10 * n_evals + 1):
        hours = step * 1e-4
        lines.append({"step": step, "gpu_hours": hours, "reward_mean": 0.0})
        if step % 10 == 0:
            lines.append({"step": step, "gpu_hours": hours, "val_pass_rate": truth.y[step // 10]})
    if finished:
        lines.append({"step": step, "gpu_hours": hours, "run_finished": True})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def test_watch_prints_a_line_per_refresh_and_redraws_the_plot(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", n_evals=3)  # 3 points after step 0: too few
    argv = ["fit", "--watch", str(run_dir), "--interval", "0", "--max-refreshes", "1"]
    assert main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("step 30/400") and "no forecast: " in line and "too few" in line
    write_run(run_dir, n_evals=20)
    assert main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    # budget: 200 steps took 0.02 GPU-h, so 400 steps take 0.04
    assert line.startswith("step 200/400") and "-> R(0.04) = " in line
    png = run_dir / "reward_curve.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000


def test_watch_follows_the_run_until_it_finishes(tmp_path):
    from megatron_rl.scaling.watch import watch

    run_dir = write_run(tmp_path / "run", n_evals=10)
    growth = iter([15, 20, 25])
    lines = []

    class Out:
        def write(self, text):
            lines.extend(text.splitlines())

        def flush(self):
            pass

    def sleep(seconds):  # the run moves on between refreshes, then finishes
        n = next(growth)
        write_run(run_dir, n_evals=n, finished=n == 25)

    assert watch(run_dir, interval=5, plot=tmp_path / "w.png", out=Out(), sleep=sleep) == 0
    assert [line.split()[1] for line in lines] == ["100/400", "150/400", "200/400", "250/400"]
    assert lines[-1].endswith("[finished]") and "R(0.04)" in lines[-1]
    assert (tmp_path / "w.png").is_file()


def test_watch_stops_on_ctrl_c(tmp_path):
    from megatron_rl.scaling.watch import watch

    run_dir = write_run(tmp_path / "run", n_evals=6)

    def interrupt(seconds):
        raise KeyboardInterrupt

    class Out:
        text = ""

        def write(self, text):
            self.text += text

        def flush(self):
            pass

    out = Out()
    assert watch(run_dir, interval=1, out=out, sleep=interrupt) == 0
    assert out.text.splitlines()[-1] == "stopped"


def test_live_forecast_runs_in_the_background_and_logs_when_ready(tmp_path):
    """submit / poll return at once while the worker process fits; the record arrives later
    with every forecast field, and the plot is redrawn with the fit."""
    from megatron_rl.trainer.live_forecast import LiveForecast

    run_dir = write_run(tmp_path / "run", n_evals=20)
    logged = []
    live = LiveForecast(
        run_dir / "metrics.jsonl",
        ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=5),
        run_dir / "reward_curve.png",
        "test",
        logged.append,
    )
    try:
        start = time.perf_counter()
        live.submit(200, 0.04, 0.02)  # spawns the worker: must not wait for it
        live.submit(200, 0.04, 0.02)  # busy: kept as the pending job
        live.poll({"step": 200})
        assert time.perf_counter() - start < 1.0 and not logged
        deadline = time.monotonic() + 90
        while len(logged) < 2 and time.monotonic() < deadline:
            t0 = time.perf_counter()
            live.poll({"step": 201, "gpu_hours": 0.0201})
            assert time.perf_counter() - t0 < 0.5
            time.sleep(0.1)
    finally:
        live.close(lambda: {"step": 202}, wait_seconds=0)
    assert len(logged) == 2, "the running and the pending forecasts were both logged"
    rec = logged[0]
    assert rec["step"] == 201 and rec["forecast_step"] == 200
    assert rec["forecast_pass_rate_at_budget_lo"] <= rec["forecast_pass_rate_at_budget"]
    assert rec["forecast_budget_gpu_hours"] == 0.04
    expected = forecast_run(
        load_run(run_dir / "metrics.jsonl"),
        ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=5),
        0.04,
    )
    assert rec["forecast_A"] == pytest.approx(expected.params.a)
    assert live.latest is not None
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == PNG_MAGIC


def test_a_forecast_without_enough_points_logs_nothing(tmp_path):
    from megatron_rl.trainer.live_forecast import LiveForecast

    run_dir = write_run(tmp_path / "run", n_evals=2)
    logged = []
    live = LiveForecast(
        run_dir / "metrics.jsonl",
        ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=0),
        None,
        "test",
        logged.append,
    )
    live.submit(20, 0.04, 0.002)  # 2 points: no worker is even started
    assert live._running is None and live._executor is None
    live.config.min_points = (
        4  # 4 counted (a point submitted twice): the worker starts; its fit finds 2 points
    )
    live.submit(20, 0.04, 0.002)
    live.close(lambda: {"step": 20}, wait_seconds=60)  # waits for it: a ValueError, no record
    assert logged == [] and live.latest is None


# Two domains on different curves (a math-like one that starts low and rises far, a
# code-like one that starts high and rises little); the overall rate is their mean.
DOMAIN_TRUTH = {
    "math": CurveParams(0.9, 1.5, 0.012, 0.35),
    "code": CurveParams(0.7, 2.0, 0.008, 0.62),
}


def write_mixed_run(run_dir: Path, n_evals: int) -> Path:
    """A math+code run's metrics.jsonl: ``val_pass_rate/<domain>`` drawn from each domain's
    curve (noise sd 0.005) every 10 steps at 1e-4 GPU-hours a step, and a third domain
    validated only twice (too few points to fit)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    lines = []
    for step in range(0, 10 * n_evals + 1, 10):
        hours = step * 1e-4
        rates = {d: float(p.predict(np.array([hours]))[0]) for d, p in DOMAIN_TRUTH.items()}
        rates = {d: r + rng.normal(0.0, 0.005) for d, r in rates.items()}
        record = {"step": step, "gpu_hours": hours, "val_pass_rate": sum(rates.values()) / 2}
        record.update({f"val_pass_rate/{d}": r for d, r in rates.items()})
        if step in (0, 10):
            record["val_pass_rate/rare"] = 0.5 + step / 100
        lines.append({"step": step, "gpu_hours": hours, "reward_mean": 0.0})
        lines.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run_dir


def test_each_domain_is_forecast_from_its_own_points(tmp_path):
    """Each domain's forecast recovers its own curve (not the other's, not the mean's); its
    fields are the overall ones suffixed with /<domain>; a domain too sparse to fit is
    skipped with its reason, without stopping the others."""
    from megatron_rl.scaling.forecast import forecast_metrics

    path = write_mixed_run(tmp_path / "run", n_evals=30) / "metrics.jsonl"
    config = ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=10)
    budget = 0.04  # 400 steps; the points reach 0.03
    result = forecast_metrics(path, config, budget, growing=False)
    assert list(result.domains) == ["math", "code"]
    assert "rare" in result.skipped and "rare" not in result.domains
    for domain, truth in DOMAIN_TRUTH.items():
        f = result.domains[domain]
        true_at_budget = float(truth.predict(np.array([budget]))[0])
        assert abs(f.pass_rate_at_budget - true_at_budget) < 0.02, (domain, f.params)
        assert abs(f.params.a - truth.a) < 0.05, (domain, f.params)
        assert f.n_points == 30  # every point but step 0 (x = 0: R0)
    # the two truths are far apart at the budget, so a swapped or averaged fit fails above
    at_budget = [float(p.predict(np.array([budget]))[0]) for p in DOMAIN_TRUTH.values()]
    assert abs(at_budget[0] - at_budget[1]) > 0.1
    rec = result.record()
    overall = forecast_run(load_run(path), config, budget)
    assert rec["forecast_A"] == pytest.approx(overall.params.a)
    for domain in ("math", "code"):
        f = result.domains[domain]
        assert rec[f"forecast_A/{domain}"] == f.params.a
        assert rec[f"forecast_pass_rate_at_budget/{domain}"] == f.pass_rate_at_budget
        low, high = rec[f"forecast_C_mid_lo/{domain}"], rec[f"forecast_C_mid_hi/{domain}"]
        assert low <= rec[f"forecast_C_mid/{domain}"] <= high
    assert not any(k.endswith("/rare") for k in rec)
    assert "math " in result.summary_line() and "code " in result.summary_line()


def test_live_forecast_logs_and_plots_each_domain(tmp_path, monkeypatch):
    """The background forecast of a mixture logs forecast_*/<domain> to metrics.jsonl and
    TensorBoard; the plot draws each domain's fit and band in the colour of its line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_rl.scaling import records as metrics_module
    from megatron_rl.scaling.records import plot_reward_curve, read_records
    from megatron_rl.trainer.live_forecast import LiveForecast
    from megatron_rl.trainer.metrics import MetricsLogger

    run_dir = write_mixed_run(tmp_path / "run", n_evals=20)
    config = ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=5)
    logger = MetricsLogger(run_dir, tensorboard=True)
    live = LiveForecast(logger.path, config, run_dir / "reward_curve.png", "mix", logger.log)
    try:
        live.submit(200, 0.04, 0.02)
        deadline = time.monotonic() + 90
        while live.latest is None and time.monotonic() < deadline:
            live.poll({"step": 201, "gpu_hours": 0.0201})
            time.sleep(0.1)
    finally:
        live.close(lambda: {"step": 202}, wait_seconds=0)
        logger.close()
    rec = [r for r in read_records(logger.path) if "forecast_step" in r]
    assert len(rec) == 1
    assert {"forecast_A/math", "forecast_A/code", "forecast_pass_rate_at_budget/math"} <= set(
        rec[0]
    )
    assert rec[0]["forecast_A/math"] == live.latest.domains["math"].params.a
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"forecast_A/math", "forecast_A/code", "forecast_A"} <= tags
    assert (run_dir / "reward_curve.png").read_bytes()[:8] == PNG_MAGIC

    drawn = []  # the plot of the worker, drawn again here to see what it draws
    original = metrics_module._draw_forecast

    def spy(ax, forecast, color="C3", domain=""):
        lines = {line.get_label(): line.get_color() for line in ax.get_lines()}
        drawn.append((domain, color, lines.get(f"val_pass_rate/{domain}")))
        original(ax, forecast, color, domain)

    monkeypatch.setattr(metrics_module, "_draw_forecast", spy)
    latest = live.latest
    plot_reward_curve(
        logger.path,
        tmp_path / "again.png",
        forecast=latest.overall,
        domain_forecasts=latest.domains,
    )
    assert [d for d, _, _ in drawn] == ["", "math", "code"]
    for domain, color, line_color in drawn[1:]:
        assert color == line_color is not None, domain
    assert drawn[1][1] != drawn[2][1]

"""`megatron-rl tournament`: the spec, the early-stop rule, resume, the table and the plot,
with fake runs that write validations drawn from known curves (no trainer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.cli import main
from megatron_rl.config.errors import ConfigError
from megatron_rl.scaling import CurveParams
from megatron_rl.scaling.tournament import runner
from megatron_rl.scaling.tournament.judge import FINISHED, STOPPED
from megatron_rl.scaling.tournament.spec import load_spec, plan, spec_from_dict

REPO = Path(__file__).resolve().parents[3]
BUDGET = 1.0
DX = 0.05  # a validation every 0.05 GPU-hours: 20 a run
CURVES = {
    "scalerl": CurveParams(a=0.70, b=2.0, c_mid=0.15, r0=0.2),
    "near_tie": CurveParams(a=0.69, b=2.0, c_mid=0.15, r0=0.2),
    "low_lr": CurveParams(a=0.40, b=2.0, c_mid=0.15, r0=0.2),
    # issue 48's CPU proof: a learning rate too high falls below its start and stays there
    "diverges": CurveParams(a=0.05, b=2.0, c_mid=0.1, r0=0.2),
    # one that stalls just below its start (by less than the 0.02 margin: it does not fall)
    "stalls": CurveParams(a=0.186, b=2.0, c_mid=0.02, r0=0.2),
    # a crossing: "fast" bends early to a lower ceiling, "slow" bends later to a higher one;
    # at 1.2 GPU-hours fast is ahead (0.650 against 0.624), at infinite compute slow is
    "fast": CurveParams(a=0.65, b=3.0, c_mid=0.05, r0=0.2),
    "slow": CurveParams(a=0.80, b=1.0, c_mid=0.5, r0=0.2),
}


class FakeRun:
    """A run that logs one validation of its curve (plus noise) per poll, resuming where
    its metrics file ends, and finishes at the budget."""

    def __init__(self, params: CurveParams, run_dir: Path, seed: int) -> None:
        self.params, self.metrics = params, run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.rng = np.random.default_rng(seed)
        self.stopped = False
        if not self.metrics.exists():
            self._log({"step": 0, "gpu_hours": 0.0, "val_pass_rate": params.r0})

    def _log(self, record: dict) -> None:
        with self.metrics.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _x(self) -> float:
        return json.loads(self.metrics.read_text().splitlines()[-1])["gpu_hours"]

    def poll(self) -> int | None:
        if self.stopped:
            return 0
        x = round(self._x() + DX, 10)
        y = float(self.params.predict(x)) + self.rng.normal(0, 0.004)
        self._log({"step": round(x / DX), "gpu_hours": x, "val_pass_rate": y})
        if x >= BUDGET - 1e-9:
            self._log({"step": round(x / DX), "gpu_hours": x, "run_finished": True})
            return 0
        return None

    def stop(self) -> None:
        self.stopped = True


class FakeExecutor:
    capacity = 1

    def __init__(self, interrupt_after: int | None = None) -> None:
        self.started: list[str] = []
        self.overrides: dict[str, list[str]] = {}
        self.polls = 0
        self.interrupt_after = interrupt_after

    def start(self, name, recipe, overrides, run_dir):
        self.started.append(name)
        self.overrides[name] = overrides
        run = FakeRun(CURVES[name], run_dir, seed=len(self.started))
        executor = self

        class Handle:
            job = name

            def poll(self):
                executor.polls += 1
                if executor.interrupt_after and executor.polls > executor.interrupt_after:
                    raise KeyboardInterrupt  # the tournament command is killed
                return run.poll()

            def stop(self):
                run.stop()

        return Handle()

    def attach(self, name, job, run_dir):
        return None


def make_spec(tmp_path: Path, variants=("scalerl", "low_lr"), **extra):
    data = {
        "name": "fake",
        "base": str(REPO / "recipes" / "tiny_cpu.yaml"),
        "budget_gpu_hours": BUDGET,
        "target_gpu_hours": 4.0,
        "fit": {"min_gpu_hours": 0, "grid": "auto", "bootstrap": 30},
        "variants": {v: [] for v in variants},
        **extra,
    }
    return spec_from_dict(data, tmp_path)


def test_a_clear_loser_is_stopped_after_its_curve_bends_and_the_winner_is_ranked_first(tmp_path):
    spec = make_spec(tmp_path, ("scalerl", "near_tie", "low_lr"), rank_by="asymptote")
    results = runner.run_tournament(spec, tmp_path, FakeExecutor(), 0, start=[])
    by_name = {r.name: r for r in results}
    assert by_name["scalerl"].status == FINISHED
    # A within 0.01 of the leader: never confidently below it, runs to the end
    assert by_name["near_tie"].status == FINISHED
    low = by_name["low_lr"]
    assert low.status == STOPPED and low.stopped_at < BUDGET
    # the rule waited for 3 fitted points past the upper end of C_mid's interval
    assert low.points_past_c_mid() >= 3
    lo, hi = low.a_interval()
    assert hi < by_name["scalerl"].a_interval()[0]
    assert lo <= 0.40 + 0.03  # the true A lies about in its interval
    table = runner.finish(spec, tmp_path, results)
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["rank", "variant"]
    # A within the paper's 0.02 of each other: ranked by B (faster first); the loser last
    fits = {r.name: r.fit.fit.params for r in results}
    top = sorted(["scalerl", "near_tie"], key=lambda n: -fits[n].b)
    assert abs(fits["scalerl"].a - fits["near_tie"].a) <= 0.02
    assert [line.split()[1] for line in lines[1:4]] == [*top, "low_lr"]
    assert f"stopped early at {low.stopped_at:.4g}" in lines[3]
    saved = BUDGET - low.stopped_at
    spent = sum(r.spent for r in results)
    assert spent == pytest.approx(3 * BUDGET - saved)
    assert f"early stopping saved {saved:.4g}" in table
    # the target (4.0) lies beyond the budget (1.0): the compute against all run to it
    assert f"to the target (4 each): {100 * spent / 12:.0f}% of 12" in table
    assert (tmp_path / "tournament.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    state = json.loads((tmp_path / "tournament.json").read_text())
    assert state["variants"]["low_lr"]["status"] == STOPPED
    assert state["ranking"] == [*top, "low_lr"]
    assert state["saved_gpu_hours"] == pytest.approx(saved)
    # R at the target: the fitted curve there (the paper's formula written out)
    fit = state["results"]["scalerl"]["fit"]
    expected = fit["R0"] + (fit["A"] - fit["R0"]) / (1 + (fit["C_mid"] / 4.0) ** fit["B"])
    assert state["results"]["scalerl"]["target_prediction"] == pytest.approx(expected)


def _fit_all(tmp_path: Path, names: tuple[str, ...]) -> list:
    """Each named curve run to the budget (FakeRun) and fitted as the judge fits it."""
    from megatron_rl.scaling.config import ForecastConfig
    from megatron_rl.scaling.tournament import judge

    config = ForecastConfig(min_gpu_hours=0, grid="auto", bootstrap=30)
    out = []
    for seed, name in enumerate(names):
        run = FakeRun(CURVES[name], tmp_path / name, seed)
        while run.poll() is None:
            pass
        out.append(judge.fit_variant(name, tmp_path / name / "metrics.jsonl", FINISHED, config))
    return out


def test_ranking_by_the_target_follows_the_curves_there_and_by_the_asymptote_follows_a(tmp_path):
    """Issue 48: a tournament predicts which variant is best at the target budget. Two
    curves cross beyond it: at 1.2 GPU-hours "fast" is ahead (0.650 against 0.624, the
    paper's formula), while "slow" has the higher A (0.80 against 0.65)."""
    from megatron_rl.scaling.tournament import judge

    results = _fit_all(tmp_path, ("slow", "fast"))
    by_target = judge.ranking(results, 1.2, "target")
    by_a = judge.ranking(results, 1.2, "asymptote")
    assert [r.name for r in by_target] == ["fast", "slow"]
    assert [r.name for r in by_a] == ["slow", "fast"]
    fits = {r.name: r.fit for r in results}
    assert fits["fast"].predict(1.2) == pytest.approx(CURVES["fast"].predict(1.2), abs=0.01)
    assert fits["slow"].predict(1.2) == pytest.approx(CURVES["slow"].predict(1.2), abs=0.01)
    table = judge.format_table(results, 1.2, BUDGET, rank_by="target").splitlines()
    assert [line.split()[1] for line in table[1:3]] == ["fast", "slow"]


def test_a_variant_that_falls_is_stopped_early_and_one_that_stalls_after_the_leaders_c_mid(
    tmp_path,
):
    """Issue 48's CPU proof: a learning rate far too high fell below its first validation
    and stayed there. Without a gain the sigmoid has no fit and no interval to compare. A
    variant whose last 3 validations lie more than 0.02 below its first, while another's
    band lies above it, is stopped then; one that stalls just below its start is stopped
    once it has 3 validations past the leader's C_mid without rising. Both rank last."""
    spec = make_spec(tmp_path, ("scalerl", "diverges", "stalls"))
    results = runner.run_tournament(spec, tmp_path, FakeExecutor(), 0, start=[])
    by_name = {r.name: r for r in results}
    leader_c_mid = by_name["scalerl"].fit.bootstrap.interval("c_mid")[1]
    fell, stalled = by_name["diverges"], by_name["stalls"]
    assert fell.status == STOPPED and fell.fit is None
    xs, ys = fell.points
    assert all(y < ys[0] - 0.02 for y in ys[-3:]) and not all(y < ys[0] - 0.02 for y in ys[-4:])
    assert xs[-1] < leader_c_mid  # before the rule for stalls could apply
    assert stalled.status == STOPPED and stalled.fit is None
    xs, ys = stalled.points
    assert sum(x > leader_c_mid for x in xs) == 3 and max(ys[1:]) <= ys[0]
    assert not any(all(y < ys[0] - 0.02 for y in ys[k : k + 3]) for k in range(len(ys)))
    state = json.loads((tmp_path / "tournament.json").read_text())
    assert "lie more than 0.02 below its first" in state["variants"]["diverges"]["reason"]
    assert "no validation above its first" in state["variants"]["stalls"]["reason"]
    table = runner.finish(spec, tmp_path, results).splitlines()
    assert [line.split()[0] for line in table[1:4]] == ["1", "2", "3"]
    assert table[1].split()[1] == "scalerl"
    ranking = json.loads((tmp_path / "tournament.json").read_text())["ranking"]
    assert ranking[0] == "scalerl" and set(ranking[1:]) == {"diverges", "stalls"}


def test_running_the_command_again_resumes(tmp_path):
    spec = make_spec(tmp_path)
    first = FakeExecutor(interrupt_after=25)  # killed while the second variant runs
    with pytest.raises(KeyboardInterrupt):
        runner.run_tournament(spec, tmp_path, first, 0, start=[])
    assert first.started == ["scalerl", "low_lr"]
    points = (tmp_path / "low_lr" / "metrics.jsonl").read_text().count("val_pass_rate")
    second = FakeExecutor()
    results = runner.run_tournament(spec, tmp_path, second, 0, start=[])
    assert second.started == ["low_lr"]  # the finished one is not run again
    # the resumed run continued its metrics file, not a new one
    records = (tmp_path / "low_lr" / "metrics.jsonl").read_text().splitlines()
    xs = [json.loads(r)["gpu_hours"] for r in records]
    assert xs == sorted(xs) and len(records) > points
    assert {r.name: r.status for r in results} == {"scalerl": FINISHED, "low_lr": STOPPED}
    third = FakeExecutor()
    runner.run_tournament(spec, tmp_path, third, 0, start=[])
    assert third.started == []  # stopped and finished variants stay so


def test_every_variant_gets_the_shared_start_and_the_budget(tmp_path):
    spec = make_spec(tmp_path, overrides=["validation.every_steps=5"])
    spec.variants["low_lr"] = ["optimizer.lr=1.0e-5"]
    executor = FakeExecutor()
    start = ["model.hf_path=/shared/hf", "warm_start.steps=0"]
    runner.run_tournament(spec, tmp_path, executor, 0, start=start)
    assert executor.overrides["low_lr"] == [
        "validation.every_steps=5",
        "optimizer.lr=1.0e-5",
        f"training.max_gpu_hours={BUDGET!r}",
        *start,
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"variants": {"a": ["warm_start.steps=5"]}}, "variants.a"),
        ({"variants": {"a": ["model.hf_path=/x"]}}, "may not change model.hf_path"),
        ({"variants": {"a": ["optimizer.lr=-1"]}}, "variants.a"),
        ({"target_gpu_hours": 0.5}, "below the budget per variant"),
        ({"colour": "red"}, "recipe key 'colour': unknown key"),
        ({"fit": {"grid": "mesh"}}, "recipe key 'fit.grid'"),
        ({"early_stop": {"points_past_c_mid": 0}}, "early_stop.points_past_c_mid"),
        ({"rank_by": "a"}, "rank_by"),
    ],
)
def test_bad_specs_name_the_key(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        make_spec(tmp_path, **change) if "variants" not in change else spec_from_dict(
            {
                "name": "x",
                "base": str(REPO / "recipes" / "tiny_cpu.yaml"),
                "budget_gpu_hours": 1,
                "target_gpu_hours": 2,
                **change,
            },
            tmp_path,
        )


def test_the_8b_ablation_spec_renders_its_jobs_and_plans_gpu_hours(capsys, tmp_path):
    path = REPO / "recipes" / "tournaments" / "scalerl_8b_ablations.yaml"
    spec = load_spec(path)
    plans = plan(spec)
    assert len(plans) == len(spec.variants) >= 6
    for p in plans:
        assert p.gpus == 80 and p.budget_gpu_hours == spec.budget_gpu_hours
        assert p.wall_hours == pytest.approx(spec.budget_gpu_hours / 80)
    argv = ["tournament", str(path), "--dry-run", "--dir", str(tmp_path / "t")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in spec.variants:
        row = next(line for line in out.splitlines() if line.split()[:1] == [name])
        assert f"{spec.budget_gpu_hours:,.6g}" in row
        assert f"# ===== {name}: {tmp_path / 't' / name / 'job.sbatch'}" in out
    assert out.count("#SBATCH --nodes=20") == len(spec.variants)
    assert f"total: {len(plans) * spec.budget_gpu_hours:,.6g} training GPU-hours" in out
    assert not (tmp_path / "t").exists()  # a dry run writes nothing


def test_a_run_of_zero_steps_is_the_warm_start_only():
    """The shared warm start is a run with training.max_steps=0; a negative count is refused."""
    from megatron_rl.config import load_run_config

    recipe = REPO / "recipes" / "tiny_cpu.yaml"
    assert load_run_config(recipe, ["training.max_steps=0"]).training.max_steps == 0
    with pytest.raises(ConfigError, match="training.max_steps"):
        load_run_config(recipe, ["training.max_steps=-1"])


def test_a_killed_command_stops_its_local_runs(tmp_path):
    """Ctrl-C on the tournament: its local runs (own sessions, so the terminal's SIGINT
    does not reach them) get SIGTERM (they checkpoint and exit) and resume next time."""
    import subprocess
    import sys

    procs = []

    class Sleeper(runner.LocalExecutor):
        def start(self, name, recipe, overrides, run_dir):
            proc = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
            )
            procs.append(proc)
            return runner.LocalHandle(proc, open(tmp_path / f"{name}.log", "a"))

    def interrupt(seconds):
        raise KeyboardInterrupt

    spec = make_spec(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        runner.run_tournament(spec, tmp_path, Sleeper(), 0, start=[], sleep=interrupt)
    assert len(procs) == 1 and procs[0].poll() is not None  # stopped, not left behind
    state = json.loads((tmp_path / "tournament.json").read_text())
    assert state["variants"]["scalerl"]["status"] == "pending"


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "tournaments").glob("*.yaml")))
def test_every_shipped_tournament_spec_loads(path):
    spec = load_spec(path)
    assert spec.variants and plan(spec)

"""Running a tournament: each variant a normal run directory ``TDIR/<variant>`` trained by a
local process (``megatron-rl train``) or a Slurm job (``megatron-rl launch``), judged as its
validations arrive, stopped early by the rule of :mod:`.judge`, resumable.

``TDIR/tournament.json`` keeps each variant's status; running the same command again
resumes: finished and stopped variants stay as they are, the others resume their run
directories (a run resumes from its latest checkpoint) or start; a Slurm job still queued
or running is followed again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from megatron_rl.config.errors import ConfigError
from megatron_rl.scaling.tournament import judge
from megatron_rl.scaling.tournament.judge import (
    FAILED,
    FINISHED,
    PENDING,
    RUNNING,
    STOPPED,
    VariantResult,
)
from megatron_rl.scaling.tournament.spec import TournamentSpec, load_variant

logger = logging.getLogger(__name__)

STATE_FILE = "tournament.json"
WARM_START_DIR = "_warm_start"  # the shared warm start's run (a variant may not be named so)
STOP_WAIT_SECONDS = 300.0  # a stopped local run checkpoints, then exits


class Handle(Protocol):
    """A variant's run in progress."""

    def poll(self) -> int | None:
        """None while it runs; its exit status once it ended."""

    def stop(self) -> None:
        """Stop it (it checkpoints and exits, as on a preemption) and wait for it."""


class Executor(Protocol):
    """Starts runs: ``megatron-rl train`` here, or a Slurm job."""

    capacity: int  # runs at a time

    def start(self, name: str, recipe: Path, overrides: list[str], run_dir: Path) -> Handle: ...

    def attach(self, name: str, job: str, run_dir: Path) -> Handle | None:
        """The run of an earlier command still in progress (a Slurm job), or None."""


# -- local processes -----------------------------------------------------------------------


def cli_command(*args: str) -> list[str]:
    """``megatron-rl ARGS`` with this interpreter."""
    return [sys.executable, "-m", "megatron_rl.cli", *args]


def _child_env() -> dict[str, str]:
    from megatron_rl.platform import LAUNCHER_VARS

    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}


@dataclass
class LocalHandle:
    proc: subprocess.Popen
    log: object

    @property
    def job(self) -> str:
        return str(self.proc.pid)

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None:
            self.log.close()  # type: ignore[attr-defined]
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # checkpoint.on_signals: save, then exit
            try:
                self.proc.wait(STOP_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                logger.warning("run %d did not stop in %.0f s: killed", self.proc.pid, 300)
                self.proc.kill()
                self.proc.wait()
        self.log.close()  # type: ignore[attr-defined]


@dataclass
class LocalExecutor:
    """``megatron-rl train`` processes on this machine, ``capacity`` at a time; each run's
    output in ``RUN_DIR.log`` beside its directory."""

    capacity: int = 1

    def start(self, name: str, recipe: Path, overrides: list[str], run_dir: Path) -> LocalHandle:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(run_dir.with_suffix(".log"), "a")  # noqa: SIM115 (closed by the handle)
        command = cli_command("train", str(recipe), *overrides, "--run-dir", str(run_dir))
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), start_new_session=True
        )
        logger.info("variant %s: started (pid %d), log %s", name, proc.pid, log.name)
        return LocalHandle(proc, log)

    def attach(self, name: str, job: str, run_dir: Path) -> Handle | None:
        return None  # a local run does not outlive the command that started it


# -- Slurm ---------------------------------------------------------------------------------


@dataclass
class SlurmHandle:
    job: str
    run_dir: Path

    def poll(self) -> int | None:
        proc = subprocess.run(
            ["squeue", "-h", "-j", self.job, "-o", "%T"], capture_output=True, text=True
        )
        if proc.returncode == 0 and proc.stdout.strip():
            return None
        return 0 if judge.finished(self.run_dir / "metrics.jsonl") else 1

    def stop(self) -> None:
        # Slurm's SIGTERM: the trainer checkpoints (checkpoint.on_signals) before the kill
        subprocess.run(["scancel", "--full", "--signal=TERM", self.job], check=False)
        while self.poll() is None:
            time.sleep(10.0)


@dataclass
class SlurmExecutor:
    """One job per variant through ``megatron-rl launch`` (all submitted at once)."""

    capacity: int = 1 << 30
    launch_args: list[str] = field(default_factory=list)  # e.g. --device cpu

    def start(self, name: str, recipe: Path, overrides: list[str], run_dir: Path) -> SlurmHandle:
        command = cli_command("launch", str(recipe), *overrides, "--run-dir", str(run_dir))
        proc = subprocess.run([*command, *self.launch_args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"variant {name}: megatron-rl launch failed: {proc.stderr.strip()}")
        job = proc.stdout.split("submitted job", 1)[1].split(":", 1)[0].strip()
        logger.info("variant %s: submitted job %s", name, job)
        return SlurmHandle(job, run_dir)

    def attach(self, name: str, job: str, run_dir: Path) -> Handle | None:
        handle = SlurmHandle(job, run_dir)
        return handle if handle.poll() is None else None


# -- state -----------------------------------------------------------------------------------


@dataclass
class State:
    """``TDIR/tournament.json``: per variant its status, job, and when and why it stopped."""

    path: Path
    variants: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, tdir: Path, names: list[str]) -> State:
        path = tdir / STATE_FILE
        variants = {}
        if path.is_file():
            try:
                variants = json.loads(path.read_text()).get("variants", {})
            except ValueError as err:
                raise ConfigError(f"{path}: unreadable ({err}); remove it to start over") from None
        return cls(path, {n: variants.get(n, {"status": PENDING}) for n in names})

    def status(self, name: str) -> str:
        return self.variants[name]["status"]

    def set(self, name: str, **values: object) -> None:
        self.variants[name].update(values)
        self.save()

    def save(self, extra: dict | None = None) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"variants": self.variants, **(extra or {})}
        tmp = self.path.with_name(self.path.name + ".part")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.path)


# -- the shared start ------------------------------------------------------------------------


def shared_start(spec: TournamentSpec, tdir: Path, local: bool) -> list[str]:
    """Overrides that start every variant from one checkpoint. The base recipe's
    ``model.hf_path`` is shared as it is (nothing to add); a warm-starting recipe
    (``warm_start.steps`` > 0) is warm-started once here, in ``TDIR/_warm_start``, and every
    variant starts from that run's step-0 weights (exported to HF) without a warm start."""
    config = load_variant(spec, next(iter(spec.variants)))
    if config.warm_start.steps == 0:
        return []
    if not local:
        raise ConfigError(
            f"{spec.base}: warm_start.steps is {config.warm_start.steps}: on Slurm every "
            "variant must start from one checkpoint: set model.hf_path (an SFT'd checkpoint) "
            "and warm_start.steps=0 in the base recipe or the spec's overrides"
        )
    run_dir = tdir / WARM_START_DIR
    hf = run_dir / "hf"
    if not (hf / "config.json").is_file():
        _warm_start(spec, run_dir, hf)
    return [f"model.hf_path={hf}", "warm_start.steps=0"]


def _warm_start(spec: TournamentSpec, run_dir: Path, hf: Path) -> None:
    logger.info("the shared warm start: %s", run_dir)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    overrides = [
        *spec.overrides,
        "training.max_steps=0",  # the warm start, then the checkpoint of step 0
        "validation.at_start=false",
        "checkpoint.save_at_end=true",
        "forecast.enabled=false",
    ]
    with open(run_dir.with_suffix(".log"), "a") as log:
        for command in (
            cli_command("train", str(spec.base), *overrides, "--run-dir", str(run_dir)),
            cli_command(
                "convert",
                "mcore-to-hf",
                str(run_dir / "checkpoints" / "step_00000000" / "model"),
                str(hf.with_name("hf.part")),
            ),
        ):
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=_child_env())
            if code.returncode != 0:
                raise RuntimeError(
                    f"the shared warm start failed ({' '.join(command[3:5])}): see {log.name}"
                )
    shutil.rmtree(hf, ignore_errors=True)
    hf.with_name("hf.part").rename(hf)


# -- the tournament --------------------------------------------------------------------------


def run_tournament(
    spec: TournamentSpec,
    tdir: Path,
    executor: Executor,
    poll_seconds: float = 15.0,
    start: list[str] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> list[VariantResult]:
    """Run (or resume) every variant, judging them as validations arrive; returns the
    final results (see :func:`finish` for the table and plot). ``start``: the overrides of
    the shared start (default: :func:`shared_start`)."""
    names = list(spec.variants)
    state = State.load(tdir, names)
    if start is None:
        start = shared_start(spec, tdir, isinstance(executor, LocalExecutor))
    running: dict[str, Handle] = {}
    for name in names:  # a job of an earlier command still in progress is followed again
        info = state.variants[name]
        if info["status"] == RUNNING and info.get("job"):
            handle = executor.attach(name, info["job"], tdir / name)
            if handle is not None:
                running[name] = handle
    todo = [n for n in names if state.status(n) not in (FINISHED, STOPPED) and n not in running]
    for name in todo:  # resumed from its run directory when its turn comes
        state.set(name, status=PENDING)
    cache: dict[str, tuple[int, VariantResult]] = {}
    try:
        _loop(spec, tdir, executor, state, todo, running, cache, poll_seconds, start, sleep)
    except BaseException:
        if isinstance(executor, LocalExecutor):  # a local run must not outlive the command
            for name, handle in running.items():  # (Slurm jobs go on: followed again later)
                logger.info("variant %s: stopping (it resumes when the command runs again)", name)
                handle.stop()
                state.set(name, status=PENDING)
        raise
    return judge_all(spec, tdir, state, cache)


def _loop(
    spec: TournamentSpec,
    tdir: Path,
    executor: Executor,
    state: State,
    todo: list[str],
    running: dict[str, Handle],
    cache: dict[str, tuple[int, VariantResult]],
    poll_seconds: float,
    start: list[str],
    sleep: Callable[[float], None],
) -> None:
    """Start variants as capacity allows, collect ended ones, judge, stop losers."""
    while todo or running:
        while todo and len(running) < executor.capacity:
            name = todo.pop(0)
            overrides = [*spec.variant_overrides(name), *start]
            running[name] = executor.start(name, spec.base, overrides, tdir / name)
            state.set(name, status=RUNNING, job=getattr(running[name], "job", None))
        sleep(poll_seconds)
        for name, handle in list(running.items()):
            code = handle.poll()
            if code is not None:
                del running[name]
                ok = code == 0 and judge.finished(tdir / name / "metrics.jsonl")
                state.set(name, status=FINISHED if ok else FAILED, exit_code=code)
                if not ok:
                    logger.error("variant %s failed (exit %s): see its log", name, code)
        results = judge_all(spec, tdir, state, cache)
        stops = judge.early_stops(results, spec.early_stop, spec.target_gpu_hours, spec.rank_by)
        for name, why in stops.items():
            if name not in running:
                continue
            logger.info("variant %s: stopped early: %s", name, why)
            running.pop(name).stop()
            spent = judge.spent_gpu_hours(tdir / name / "metrics.jsonl")
            state.set(name, status=STOPPED, stopped_at=spent, reason=why)


def judge_all(
    spec: TournamentSpec,
    tdir: Path,
    state: State,
    cache: dict[str, tuple[int, VariantResult]] | None = None,
) -> list[VariantResult]:
    """Every variant's result now; a fit is redone only when new validations arrived."""
    cache = {} if cache is None else cache
    out = []
    for name in spec.variants:
        info = state.variants[name]
        metrics = tdir / name / "metrics.jsonl"
        n = _validations(metrics)
        if name in cache and cache[name][0] == n:
            result = cache[name][1]
            result.status = info["status"]
            result.spent = judge.spent_gpu_hours(metrics)
        else:
            result = judge.fit_variant(name, metrics, info["status"], spec.fit)
            cache[name] = (n, result)
        result.stopped_at = info.get("stopped_at")
        out.append(result)
    return out


def _validations(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    return sum('"val_pass_rate"' in line for line in metrics.read_text().splitlines())


def finish(spec: TournamentSpec, tdir: Path, results: list[VariantResult]) -> str:
    """Write ``TDIR/ranking.txt``, ``TDIR/tournament.png`` and the results into
    ``TDIR/tournament.json``; return the table."""
    from megatron_rl.scaling.config import PAPER_A_TOLERANCE

    target = spec.target_gpu_hours
    table = judge.format_table(
        results, target, spec.budget_gpu_hours, PAPER_A_TOLERANCE, spec.rank_by
    )
    (tdir / "ranking.txt").write_text(table + "\n")
    png = judge.plot(results, tdir / "tournament.png", spec.target_gpu_hours, spec.name)
    state = State.load(tdir, list(spec.variants))
    s = judge.savings(results, spec.budget_gpu_hours)
    state.save(
        {
            "rank_by": spec.rank_by,
            "ranking": [r.name for r in judge.ranking(results, target, spec.rank_by)],
            "results": {r.name: _summary(r, spec.target_gpu_hours) for r in results},
            "spent_gpu_hours": s.spent,
            "full_gpu_hours": s.full,
            "saved_gpu_hours": s.saved,
            "plot": str(png) if png else None,
        }
    )
    return table


def _summary(r: VariantResult, target: float) -> dict:
    out: dict = {"status": r.status, "spent_gpu_hours": r.spent, "stopped_at": r.stopped_at}
    if r.fit is None:
        return {**out, "fit": None, "why": r.why}
    p, boot = r.fit.fit.params, r.fit.bootstrap
    out["fit"] = {"A": p.a, "B": p.b, "C_mid": p.c_mid, "R0": p.r0}
    out["intervals"] = {k: list(v) for k, v in boot.intervals().items()} if boot else None
    out["target_prediction"] = r.fit.predict(target)
    band = r.fit.prediction_interval(target)
    out["target_band"] = list(band) if band else None
    return out

"""The console of `megatron-rl train` (megatron_rl/trainer/console.py): ours first, the
libraries' output in RUN_DIR/logs/. Each case runs a small script in a process of its own (its
file descriptors are redirected), standing in for a run: library logging, prints, C-level
writes, a child process, Python warnings, then the start block, our lines, a validation line
and an error, as a run makes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import logging, os, subprocess, sys, warnings
from pathlib import Path
from megatron_rl.trainer import console
from megatron_rl.trainer.console import QUIET_KEEPS, START_BLOCK, RunConsole

run_dir, quiet, start = Path(sys.argv[1]), sys.argv[2] == "quiet", sys.argv[3] == "start"
lib, ours = logging.getLogger("vllm.engine"), logging.getLogger("megatron_rl.trainer.loop")
with RunConsole(quiet=quiet, bars=False) as con:
    lib.info("LIB-INFO before the run directory")
    lib.warning("LIB-WARNING once")
    print("LIB-PRINT megatron's parameter list")
    os.write(1, b"C-LEVEL stdout\n")
    os.write(2, b"C-LEVEL stderr\n")
    warnings.warn("PY-WARNING apex is not installed")
    ours.info("OUR-INFO before the start block")
    console.attach(run_dir)  # the run directory is claimed
    subprocess.run([sys.executable, "-c", "print('CHILD-PRINT engine process')"], check=True)
    lib.warning("LIB-WARNING once")
    if not start:  # e.g. refused, or signalled while it builds
        con.error("megatron-rl train: error: OUR-ERROR before the start block")
        sys.exit(0)
    logging.getLogger("megatron_rl.trainer.summary").info(
        "run tiny:\n  layout: one", extra=START_BLOCK
    )
    lib.warning("LIB-WARNING after the start block")
    ours.info("OUR-INFO after the start block")
    ours.info("step 0: validation pass rate 0.250", extra=QUIET_KEEPS)
    lib.error("LIB-ERROR engine died")
    con.error("megatron-rl train: error: OUR-ERROR")
print("AFTER the run: the console is the terminal again")
"""


def _run(tmp_path: Path, *, quiet: bool = False, rank: str | None = None, start: bool = True):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
    env["PYTHONPATH"] = str(ROOT)
    if rank is not None:
        env["RANK"] = rank
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(run_dir),
            "quiet" if quiet else "normal",
            "start" if start else "no-start",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc, run_dir / "logs" / f"rank{rank or 0}.log"


LIBRARY_ONLY = ("LIB-INFO", "LIB-PRINT", "C-LEVEL", "PY-WARNING", "CHILD-PRINT")


def test_the_start_block_comes_first_and_library_output_goes_to_the_log(tmp_path):
    proc, log = _run(tmp_path)
    assert proc.stdout == "AFTER the run: the console is the terminal again\n"
    lines = proc.stderr.splitlines()
    assert lines[0].endswith(" run tiny:") and lines[1] == "  layout: one", lines
    for text in LIBRARY_ONLY + ("OUR-INFO before",):
        assert text not in proc.stderr
    # a library's warning: once, after the start block, with its logger's name
    assert [line.split(" ", 1)[1] for line in lines if "LIB-WARNING" in line] == [
        "WARNING vllm.engine: LIB-WARNING once",
        "WARNING vllm.engine: LIB-WARNING after the start block",
    ]
    assert any(line.endswith(" OUR-INFO after the start block") for line in lines)
    assert any(line.endswith(" validation pass rate 0.250") for line in lines)
    assert any(line.endswith("ERROR vllm.engine: LIB-ERROR engine died") for line in lines)
    assert lines[-1] == "megatron-rl train: error: OUR-ERROR"
    # everything is in the log, what came before the run directory too, in order
    text = log.read_text()
    order = [
        "INFO vllm.engine: LIB-INFO before the run directory",
        "LIB-PRINT megatron's parameter list",
        "C-LEVEL stdout",
        "C-LEVEL stderr",
        "WARNING py.warnings:",
        "INFO megatron_rl.trainer.loop: OUR-INFO before the start block",
        "CHILD-PRINT engine process",
        "INFO megatron_rl.trainer.summary: run tiny:",
        "OUR-INFO after the start block",
        "ERROR vllm.engine: LIB-ERROR engine died",
        "megatron-rl train: error: OUR-ERROR",
    ]
    positions = [text.index(needle) for needle in order]
    assert positions == sorted(positions)


def test_quiet_shows_the_validations_and_errors_only(tmp_path):
    proc, log = _run(tmp_path, quiet=True)
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, lines
    assert lines[0].endswith(" step 0: validation pass rate 0.250")
    assert lines[1].endswith(" ERROR vllm.engine: LIB-ERROR engine died")
    assert lines[2] == "megatron-rl train: error: OUR-ERROR"
    assert "LIB-INFO before the run directory" in log.read_text()  # the log has it all


def test_other_ranks_show_warnings_and_errors_but_no_info(tmp_path):
    """Under torchrun, RANK 1: no INFO line (not even a start block: the main rank's), no
    validation; warnings and errors; its own log."""
    proc, log = _run(tmp_path, rank="1")
    assert "OUR-INFO" not in proc.stderr and "validation" not in proc.stderr
    assert "LIB-WARNING once" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "megatron-rl train: error: OUR-ERROR"
    assert "OUR-INFO after the start block" in log.read_text()


def test_a_run_that_ends_before_its_start_block_shows_what_waited(tmp_path):
    """Our INFO lines before the start block (what it sums up) wait for it; a run refused or
    stopped before it shows them, then the libraries' warnings, then its error, last."""
    proc, log = _run(tmp_path, start=False)
    lines = proc.stderr.splitlines()
    assert [line.split(" ", 1)[1] for line in lines[:-1]] == [
        "WARNING vllm.engine: LIB-WARNING once",
        "OUR-INFO before the start block",
    ]
    assert lines[-1] == "megatron-rl train: error: OUR-ERROR before the start block"
    assert "CHILD-PRINT" in log.read_text() and "CHILD-PRINT" not in proc.stderr


def test_help_lists_every_command_with_its_description(capsys):
    """`megatron-rl --help` (issue 47 section 5: it listed the names only)."""
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (_, description) in COMMANDS.items():
        assert any(line.split() == [name, *description.split()] for line in out.splitlines()), (
            name,
            out,
        )


def test_a_phase_of_unknown_length_shows_its_elapsed_time_then_is_erased(capsys):
    """The engines' start and a validation had no bar: 27 s of silence (issue 47)."""
    import time

    from megatron_rl.trainer import console

    with console.phase("starting 1 engine(s)"):
        time.sleep(2.5)
    err = capsys.readouterr().err
    redraws = err.split("\r")
    assert "starting 1 engine(s): 00:00" in redraws and "starting 1 engine(s): 00:02" in redraws
    assert redraws[-1].strip() == ""  # erased (leave=False)
    with console.phase("validation at step 0", main=False):  # other ranks: no bar
        pass
    assert capsys.readouterr().err == ""

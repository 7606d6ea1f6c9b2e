"""What ``megatron-rl train`` prints on its console, and where everything else goes.

The console is ours: the start block first, progress bars for the start-up's long phases (the
imports and the model build, the warm start, the engines' start, each validation), the
training bar, our log lines, the end block. Library logging at WARNING and above (vLLM,
megatron-core, torch, transformers) is shown once per message, after the start block.

Everything else goes to ``RUN_DIR/logs/rank<R>.log``: file descriptors 1 and 2 of the trainer
process are redirected there, so library INFO logs, Python warnings, megatron-core's
``print``\\ s, C++ output and whatever the processes the trainer starts write (engine processes,
reward workers: they inherit the descriptors) land in the log with our own lines. Until the
main rank has claimed the run directory (a refused run writes nothing there; ``--restart``
moves the previous run's ``logs/rank*.log`` aside with its history), the output waits in a temporary
file, then moves into the log.

``--quiet``: the progress bars, the validation lines and errors only. Under torchrun or srun
only the main rank (``RANK`` 0) shows INFO lines and bars; every rank writes its own log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOGS_DIR = "logs"  # in the run directory (a Slurm job's logs are there too)
RANK_LOGS = "rank*.log"  # ours: one per trainer rank
OURS = "megatron_rl"
# Set on a log record (``extra=``): the start block (the console's first line), and the lines
# that ``--quiet`` keeps besides errors (the validations).
START_BLOCK = {"start_block": True}
QUIET_KEEPS = {"quiet_keeps": True}
TICK_SECONDS = 1.0  # how often a phase's bar redraws its elapsed time

_active: RunConsole | None = None


def launcher_rank() -> int:
    """This process's rank as its launcher set it (torchrun ``RANK``, srun ``SLURM_PROCID``),
    known before torch.distributed starts; 0 for a single process."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def stream() -> IO[str]:
    """The console: the terminal ``megatron-rl train`` was started on, or ``sys.stderr``
    where no run console is active (a test calling ``train`` itself)."""
    return _active.console if _active is not None else sys.stderr


def bars_shown(main: bool = True) -> bool:
    """Whether this process shows progress bars (the main rank, ``logging.progress_bar``)."""
    if _active is not None:
        return _active.bars and main
    return main


def bar(iterable: Any = None, *, desc: str, main: bool = True, **kwargs: Any) -> tqdm:
    """A progress bar on the console (``tqdm`` arguments); off on other ranks than the main
    one, and with ``logging.progress_bar: false``."""
    kwargs.setdefault("leave", False)
    return tqdm(iterable, desc=desc, file=stream(), disable=not bars_shown(main), **kwargs)


@contextlib.contextmanager
def phase(desc: str, main: bool = True) -> Iterator[tqdm]:
    """A bar for work whose length is unknown (an engine's start, a validation pass): its
    elapsed time ticks every second until the work is done; it is erased then."""
    with bar(desc=desc, main=main, total=None, bar_format="{desc}: {elapsed}") as progress:
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(TICK_SECONDS):
                progress.refresh()

        ticker = threading.Thread(target=tick, name=f"phase-{desc}", daemon=True)
        if not progress.disable:
            ticker.start()
        try:
            yield progress
        finally:
            stop.set()
            if ticker.is_alive():
                ticker.join()


def attach(run_dir: Path) -> None:
    """Move the output into ``run_dir/logs/`` once the run directory is claimed (no-op where
    no run console is active)."""
    if _active is not None:
        _active.attach(run_dir)


class ConsoleHandler(logging.Handler):
    """Our records and the libraries' warnings, as the module docstring says, on the console;
    library records before the start block wait for it."""

    def __init__(self, owner: RunConsole) -> None:
        super().__init__(logging.DEBUG)
        self.owner = owner
        self.started = False  # the start block is out
        self.held: list[logging.LogRecord] = []  # libraries' warnings before the start block
        self.early: list[logging.LogRecord] = []  # our INFO lines before it
        self.seen: set[tuple[str, str]] = set()

    def shown(self, record: logging.LogRecord) -> bool:
        owner, ours = self.owner, record.name.split(".")[0] == OURS
        if record.levelno >= logging.ERROR:
            return True
        if owner.quiet:
            return ours and getattr(record, "quiet_keeps", False) and owner.main
        if not ours:
            return record.levelno >= logging.WARNING and record.name != "py.warnings"
        # Our INFO lines: the main rank's. Those before the start block (what it sums up) wait:
        # they are shown only if the run ends before it (a refusal, a signal, an error).
        return record.levelno >= logging.WARNING or owner.main

    def emit(self, record: logging.LogRecord) -> None:
        try:
            start = getattr(record, "start_block", False) and not self.started
            if start:
                self.owner.close_startup_bar()
            if self.shown(record) and self.first_time(record):
                ours = record.name.split(".")[0] == OURS
                if self.started or start or record.levelno >= logging.ERROR:
                    self.write(record)
                elif ours and record.levelno >= logging.WARNING:
                    self.write(record)
                elif ours:  # shown only if the run ends before the start block
                    self.early.append(record)
                else:  # a library's warning before the start block: after it
                    self.held.append(record)
            if start:
                self.show_held()
        except Exception:
            self.handleError(record)

    def first_time(self, record: logging.LogRecord) -> bool:
        """Ours always; a library's message once."""
        if record.name.split(".")[0] == OURS:
            return True
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def show_held(self, early: bool = False) -> None:
        """The start block is out, or the run ends without one (``early``: our INFO lines
        before it are shown too): the libraries' warnings held follow."""
        self.started = True
        self.owner.close_startup_bar()
        held = sorted(self.held + self.early, key=lambda r: r.created) if early else self.held
        self.held, self.early = [], []
        for record in held:
            self.write(record)

    def write(self, record: logging.LogRecord) -> None:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        ours = record.name.split(".")[0] == OURS
        if ours:
            level = "" if record.levelno == logging.INFO else f"{record.levelname} "
            text = f"{clock} {level}{record.getMessage()}"
        else:
            text = f"{clock} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + logging.Formatter().formatException(record.exc_info)
        tqdm.write(text, file=self.owner.console)  # clears and redraws the bars around it


class RunConsole:
    """The console of one ``megatron-rl train`` process (a context manager; see the module
    docstring). ``quiet``: ``--quiet``; ``bars``: ``logging.progress_bar``."""

    def __init__(self, quiet: bool = False, bars: bool = True, rank: int | None = None) -> None:
        self.rank = launcher_rank() if rank is None else rank
        self.main = self.rank == 0
        self.quiet = quiet
        self.bars = bars and self.main
        self.log_path: Path | None = None
        self._startup: tqdm | None = None
        self._startup_phase: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> RunConsole:
        global _active
        for s in (sys.stdout, sys.stderr):
            s.flush()
        self._saved = (os.dup(1), os.dup(2))
        # Our console: the process's stderr as it was (stdout is left to libraries too).
        self.console = open(  # noqa: SIM115 - closed in __exit__
            os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace"
        )
        self._pending = tempfile.TemporaryFile(prefix="megatron_rl_output_")  # noqa: SIM115
        self._redirect(self._pending.fileno())
        root = logging.getLogger()
        self._root_state = (root.level, root.handlers[:])
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        root.setLevel(logging.INFO)
        self.file_handler = logging.StreamHandler(sys.stderr)  # fd 2: the log
        self.file_handler.setFormatter(logging.Formatter(LOG_FORMAT))
        self.console_handler = ConsoleHandler(self)
        root.addHandler(self.file_handler)
        root.addHandler(self.console_handler)
        logging.captureWarnings(True)
        self._env, self._vllm_config = _vllm_logging_env()
        _active = self
        if self.bars:
            self._startup_phase = phase("starting (libraries, model, data)")
            self._startup = self._startup_phase.__enter__()
        return self

    def _redirect(self, fd: int) -> None:
        for s in (sys.stdout, sys.stderr):
            s.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)

    def attach(self, run_dir: Path) -> None:
        """The output from now on, and what waited, into ``run_dir/logs/rank<R>.log``."""
        if self.log_path is not None:
            return
        logs = Path(run_dir) / LOGS_DIR
        logs.mkdir(parents=True, exist_ok=True)
        self.log_path = logs / f"rank{self.rank}.log"
        log = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 - until __exit__
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"==== megatron-rl train, pid {os.getpid()}, {stamp} ====\n".encode())
        for s in (sys.stdout, sys.stderr):
            s.flush()
        self._pending.seek(0)
        while chunk := self._pending.read(1 << 20):
            log.write(chunk)
        self._redirect(log.fileno())
        self._pending.close()
        self._pending = log

    def error(self, text: str) -> None:
        """An error the user can fix, as one line: on the console (last: after what waited
        for a start block that will not come) and in the log."""
        if not self.console_handler.started:
            self.console_handler.show_held(early=True)
        self.file_handler.stream.write(text + "\n")
        self.file_handler.flush()
        tqdm.write(text, file=self.console)

    def close_startup_bar(self) -> None:
        if self._startup_phase is not None:  # the first line is coming
            phase_cm, self._startup_phase = self._startup_phase, None
            phase_cm.__exit__(None, None, None)

    def __exit__(self, exc_type, exc, tb) -> None:
        global _active
        self.close_startup_bar()
        if not self.console_handler.started:  # no start block: what waited is shown now
            self.console_handler.show_held(early=True)
        for s in (sys.stdout, sys.stderr):
            s.flush()
        failed = exc_type is not None and not issubclass(exc_type, SystemExit)
        if self.log_path is None and failed and not self.quiet:
            self._show_tail()  # failed before the run directory: the libraries' last words
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)
        root = logging.getLogger()
        root.removeHandler(self.file_handler)
        root.removeHandler(self.console_handler)
        root.setLevel(self._root_state[0])
        for handler in self._root_state[1]:
            root.addHandler(handler)
        logging.captureWarnings(False)
        for key, value in self._env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._vllm_config is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._vllm_config)
        self._pending.close()
        if self.log_path is not None and failed:
            print(f"(the libraries' output and every log line: {self.log_path})", file=self.console)
        self.console.close()
        _active = None

    def _show_tail(self, lines: int = 30) -> None:
        self._pending.seek(0)
        text = self._pending.read().decode(errors="replace").splitlines()[-lines:]
        if text:
            self.console.write("\n".join(text) + "\n")


def _vllm_logging_env() -> tuple[dict[str, str | None], str | None]:
    """vLLM's loggers hand their records to the root logger (ours: the log, and warnings on
    the console) instead of printing them with a handler of their own; in engine processes
    the root logger prints on their stderr, which goes to the log. A user's own
    ``VLLM_LOGGING_CONFIG_PATH`` or ``VLLM_CONFIGURE_LOGGING=0`` is left as is. Returns the
    variables' previous values, to restore."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") in (
        "0",
        "false",
    ):
        return {}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {"vllm": {"level": "INFO", "handlers": [], "propagate": True}},
    }
    fd, path = tempfile.mkstemp(prefix="megatron_rl_vllm_logging_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    previous = {"VLLM_LOGGING_CONFIG_PATH": os.environ.get("VLLM_LOGGING_CONFIG_PATH")}
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = path
    return previous, path

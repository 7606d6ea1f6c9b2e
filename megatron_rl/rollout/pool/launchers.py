"""The pool's handle on one engine, whatever runs it (``rollout.placement``).

The pool (:class:`~megatron_rl.rollout.pool.GeneratorPool`) talks to its engines only through
:class:`EngineHandle`; an :class:`EngineLauncher` per placement starts them, restarts them
where it can, and owns the one event source the pool reads all their events from:

- ``in_process``: :class:`ThreadEngine`, a thread of this process (events: one queue);
- ``subprocess``: :class:`ProcessEngine`, a spawned process with an event pipe of its own
  (:mod:`megatron_rl.rollout.wire`), restartable;
- ``remote``: :class:`~megatron_rl.rollout.pool.remote.RemoteEngine`, an engine task connected
  over TCP (:mod:`megatron_rl.rollout.pool.remote`).

Every engine runs :func:`megatron_rl.rollout.engine.runner.run_engine`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any, Protocol

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine.runner import run_engine, subprocess_main
from megatron_rl.rollout.messages import Command, Event, RunnerSettings
from megatron_rl.rollout.wire import EventChannels

WEIGHT_QUEUE_DEPTH = 2  # buckets queued per engine: bounds the push's extra memory


class EngineHandle(Protocol):
    """One engine as the pool sees it."""

    index: int
    log_path: str | None  # a copy of its output (the tail names the cause of a death)

    def send(self, command: Command) -> None:
        """Queue a command (:mod:`megatron_rl.rollout.messages`); never waits on the engine."""

    def put_weights(self, item: Any, timeout: float | None = None) -> None:
        """Hand over a packed bucket (None: the push's end); raises ``queue.Full`` when the
        engine's bounded queue stays full for ``timeout`` s."""

    def is_alive(self) -> bool: ...

    @property
    def pid(self) -> int | None:
        """The engine's process id (None when unknown)."""

    @property
    def exitcode(self) -> int | None: ...

    def leftover_events(self) -> list[Event]:
        """After its death: the complete events it sent that the pool did not read yet
        (those of a shared event queue are read there, in order: none here)."""

    def join(self, timeout: float | None = None) -> None: ...

    def terminate(self) -> None:
        """End it now (a stop that did not end it in time)."""

    def discard(self) -> None:
        """After its death: free what is left of it (child processes, queues)."""


class EngineLauncher(Protocol):
    """Starts the engines of one placement; ``events``: all their events as one queue
    (``get(timeout)`` / ``get_nowait()``, raising ``queue.Empty``)."""

    events: Any
    restartable: bool  # a dead engine can be started again on its devices

    def start(self, count: int) -> list[EngineHandle]: ...

    def restart(self, index: int) -> EngineHandle: ...

    def close(self) -> None: ...


class ThreadEngine:
    """An engine on a thread of this process (``placement: in_process``)."""

    log_path = None

    def __init__(
        self, index: int, hf_dir: str, config: RolloutConfig, settings: RunnerSettings, events
    ) -> None:
        self.index = index
        self.commands: queue.Queue = queue.Queue()
        self.weights: queue.Queue = queue.Queue(WEIGHT_QUEUE_DEPTH)
        self.thread = threading.Thread(
            target=run_engine,
            args=(index, hf_dir, config, settings, self.commands, self.weights.get, events),
            name=f"vllm-engine-{index}",
            daemon=True,
        )
        self.thread.start()

    def send(self, command: Command) -> None:
        self.commands.put(command)

    def put_weights(self, item: Any, timeout: float | None = None) -> None:
        self.weights.put(item, timeout=timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def exitcode(self) -> None:
        return None

    def leftover_events(self) -> list[Event]:
        return []

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def terminate(self) -> None:
        pass  # a thread cannot be ended from outside; it is a daemon

    def discard(self) -> None:
        pass


class ProcessEngine:
    """An engine process (``placement: subprocess``), with an event pipe and a log file of
    its own; its death ends the pipe (the pool reads it up to its last whole event)."""

    def __init__(
        self,
        index: int,
        ctx: Any,
        hf_dir: str,
        config: RolloutConfig,
        settings: RunnerSettings,
        channels: EventChannels,
        log_dir: str,
    ) -> None:
        self.index = index
        self._channels = channels
        self.commands, self.weights = ctx.Queue(), ctx.Queue(WEIGHT_QUEUE_DEPTH)
        reader, writer = ctx.Pipe(duplex=False)
        self.log_path = os.path.join(log_dir, f"engine-{index}.log")
        args = (index, hf_dir, config, settings, self.commands, self.weights)
        self.process = ctx.Process(
            target=subprocess_main,
            args=(*args, writer, self.log_path),
            name=f"vllm-engine-{index}",
            daemon=True,
        )
        self.process.start()
        writer.close()  # the engine holds the only write end: its death ends the pipe
        channels.add(index, reader)

    def send(self, command: Command) -> None:
        self.commands.put(command)

    def put_weights(self, item: Any, timeout: float | None = None) -> None:
        self.weights.put(item, timeout=timeout)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def leftover_events(self) -> list[Event]:
        return self._channels.drain(self.index)

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def terminate(self) -> None:
        self.process.kill()  # it ignores SIGTERM (see runner.subprocess_main)

    def discard(self) -> None:
        """End what is left of the dead process's group (e.g. vLLM workers holding its
        GPUs), so that its restart finds the devices free; drop its queues and vLLM's
        rendezvous file (a killed engine never removes it)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.join(timeout=5)
        remove_file_stores(os.path.dirname(self.log_path), self.process.pid)
        for channel in (self.commands, self.weights):
            channel.cancel_join_thread()  # nobody reads them any more: exit without flushing


class ThreadLauncher:
    """``placement: in_process``: engines on threads, their events in one queue."""

    restartable = False

    def __init__(self, hf_dir: str, config: RolloutConfig, settings: RunnerSettings) -> None:
        self.hf_dir, self.config, self.settings = hf_dir, config, settings
        self.events: queue.Queue = queue.Queue()

    def start(self, count: int) -> list[EngineHandle]:
        _check_one_rank_world()
        return [self._engine(index) for index in range(count)]

    def restart(self, index: int) -> EngineHandle:
        raise NotImplementedError("in-process engines are not restarted")

    def _engine(self, index: int) -> ThreadEngine:
        return ThreadEngine(index, self.hf_dir, self.config, self.settings, self.events)

    def close(self) -> None:
        pass


ENGINE_LOGS_PREFIX = "megatron_rl_engines_"
_OWNER_FILE = ".owner"  # flock'ed by the launcher that created the directory, while it lives
_UNOWNED_AGE_S = 86400.0  # a directory without an owner file (older versions): kept a day


def engine_logs_dir() -> tuple[str, int]:
    """A fresh temporary directory for engine logs and the descriptor of its owner lock (held
    until closed, or until the process dies: a SIGKILLed trainer's directory is then free to
    remove). The leftovers of launchers no longer alive are removed first
    (:func:`remove_orphaned_logs`)."""
    import fcntl

    remove_orphaned_logs()
    path = tempfile.mkdtemp(prefix=ENGINE_LOGS_PREFIX)
    fd = os.open(os.path.join(path, _OWNER_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return path, fd


def remove_orphaned_logs(root: str | None = None) -> list[str]:
    """Remove the engine-log directories under ``root`` (the temporary directory) whose
    launcher is gone (their owner lock is free: a killed trainer never ran ``close``);
    returns them. A directory of another live launcher (another job on this node) holds
    its lock and stays."""
    import fcntl
    import time

    root = root or tempfile.gettempdir()
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith(ENGINE_LOGS_PREFIX) or not os.path.isdir(path):
            continue
        try:
            fd = os.open(os.path.join(path, _OWNER_FILE), os.O_RDONLY)
        except FileNotFoundError:  # being created now, or made by an older version
            try:
                if time.time() - os.path.getmtime(path) > _UNOWNED_AGE_S:
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            except OSError:
                pass
            continue
        except OSError:  # another user's: not ours to remove
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its launcher lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_file_stores(directory: str, pid: int) -> list[str]:
    """Remove vLLM's rendezvous files of the engine process ``pid`` in ``directory`` (its
    launcher's: see ``vllm_engine._file_store_in``); returns them."""
    from megatron_rl.rollout.engine.vllm_engine import file_store_prefix

    prefix = file_store_prefix(pid)
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))
                    removed.append(name)
    return removed


class ProcessLauncher:
    """``placement: subprocess``: spawned engine processes, each with its event pipe and log
    (in a temporary directory that ``close`` removes; one left by a killed trainer is
    removed by the next launcher that starts on the node)."""

    restartable = True

    def __init__(self, hf_dir: str, config: RolloutConfig, settings: RunnerSettings) -> None:
        import torch.multiprocessing as mp

        self.hf_dir, self.config, self.settings = hf_dir, config, settings
        self._ctx = mp.get_context("spawn")
        self.events = EventChannels()
        self.log_dir, self._owner = engine_logs_dir()

    def start(self, count: int) -> list[EngineHandle]:
        return [self.restart(index) for index in range(count)]

    def restart(self, index: int) -> EngineHandle:
        """Start engine process ``index`` (again: its previous pipe is replaced)."""
        return ProcessEngine(
            index, self._ctx, self.hf_dir, self.config, self.settings, self.events, self.log_dir
        )

    def close(self) -> None:
        self.events.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)
        if self._owner is not None:
            os.close(self._owner)
            self._owner = None


def _remote_launcher(hf_dir: str, config: RolloutConfig, settings: RunnerSettings):
    from megatron_rl.rollout.pool.remote import RemoteLauncher

    return RemoteLauncher(hf_dir, config, settings)


LAUNCHERS: dict[str, Callable[[str, RolloutConfig, RunnerSettings], EngineLauncher]] = {
    "in_process": ThreadLauncher,
    "subprocess": ProcessLauncher,
    "remote": _remote_launcher,
}


def engine_launcher(hf_dir: str, config: RolloutConfig, settings: RunnerSettings):
    """The launcher of ``config.placement`` (validated by ``RolloutConfig.validate``)."""
    return LAUNCHERS[config.placement](hf_dir, config, settings)


def _check_one_rank_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "rollout.placement 'in_process' runs vLLM inside this process, which needs a "
            f"one-rank torch.distributed world (this one has {dist.get_world_size()}); "
            "use placement: subprocess"
        )


def runner_settings(
    config: RolloutConfig, hf_config: Any, policy: Any = None, sandbox: Any = None
) -> RunnerSettings:
    """What every engine's runner needs besides the config: the stop tokens (the config's,
    else the model's EOS), the interruption ``policy``'s token ids, if any, and for
    multi-turn episodes the ``sandbox`` their tools run in (the run's ``reward`` section;
    None: its defaults)."""
    stop = config.stop_token_ids
    if stop is None:
        eos = getattr(hf_config, "eos_token_id", None)
        stop = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if config.episodes and sandbox is None:
        from megatron_rl.rewards.config import RewardConfig

        sandbox = RewardConfig()
    if policy is None:
        return RunnerSettings(tuple(stop), sandbox=sandbox)
    return RunnerSettings(
        tuple(stop), policy.text_ids, policy.close_ids, policy.answer_budget, sandbox
    )


def hf_text_config(hf_dir: str) -> Any:
    """The HF config of ``hf_dir``'s text model."""
    from megatron_rl.models.hf_config import load_text_config

    return load_text_config(hf_dir)


def hf_encoder(hf_dir: str) -> Callable[[str], list[int]]:
    """Text -> token ids (no special tokens) by ``hf_dir``'s tokenizer."""
    from pathlib import Path

    if not any(Path(hf_dir).glob("tokenizer*")):
        raise ValueError(
            "rollout.interruption needs a tokenizer: pass encode= or put one in the model dir"
        )
    from megatron_rl.models.hf_config import load_tokenizer

    tokenizer = load_tokenizer(hf_dir)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)

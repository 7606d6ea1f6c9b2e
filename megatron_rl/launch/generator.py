"""A generator task: one vLLM engine served to the trainer over TCP.

    python -m megatron_rl.launch.generator [--connect HOST:PORT] [--engine N]

Run by the sbatch script of ``megatron-rl launch`` (one task per engine, ``--engine`` =
``SLURM_PROCID``); the address and the key come from ``$MEGATRON_RL_GENERATOR_ADDR`` and
``$MEGATRON_RL_GENERATOR_KEY``. The task supervises one engine process (the same command
with ``--no-supervise``), which connects to the trainer (retrying until it listens),
receives the model directory and the rollout settings, and runs the same engine loop as the
pool's other placements until the trainer sends ``stop`` (exit 0) or goes away (exit 3).
An engine process that dies otherwise (killed by a signal: SIGKILL, the OOM killer, a
crash) is started again on the same devices and reconnects; the trainer's pool treats that
as a restart (its requests are resubmitted, it gets the current weights,
``rollout.engine_max_restarts`` applies). Exits 1 (its engine failed: the trainer has the
traceback), 2 (bad environment, no trainer) and 4 (rejected) end the task with that status.

SIGTERM and SIGUSR1 are logged and otherwise ignored: at preemption or the pre-timeout
signal the trainer still needs its engines to finish the step it checkpoints at; the trainer
ends the engines when it is done (and Slurm's SIGKILL ends them in the worst case).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from megatron_rl.platform.config import LAUNCHER_VARS
from megatron_rl.rollout.engine import serve
from megatron_rl.rollout.engine.nccl_env import drop_trainer_only_vars

logger = logging.getLogger("megatron_rl.launch.generator")


def _parse_address(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _note_signal(signum: int, frame) -> None:
    logger.warning(
        "%s: keeping the engine up until the trainer stops it", signal.Signals(signum).name
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one engine to the trainer; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.launch.generator")
    parser.add_argument(
        "--connect",
        type=_parse_address,
        default=None,
        help=f"the trainer's HOST:PORT (default: ${serve.ADDR_ENV})",
    )
    parser.add_argument(
        "--engine",
        type=int,
        default=int(os.environ.get("SLURM_PROCID", 0)),
        help="this engine's index in the pool (default: $SLURM_PROCID)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        help=f"seconds to wait for the trainer (default: ${serve.CONNECT_TIMEOUT_ENV} or "
        f"{serve.DEFAULT_CONNECT_TIMEOUT:.0f})",
    )
    parser.add_argument(
        "--no-supervise",
        action="store_true",
        help="serve the engine in this process (the supervised engine process does)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # The engine forms its own one-process world: the trainer's rendezvous variables, which
    # the job exports to every task, would only confuse it.
    for name in LAUNCHER_VARS:
        os.environ.pop(name, None)
    drop_trainer_only_vars()  # CUDA_DEVICE_MAX_CONNECTIONS: Megatron's, not vLLM's
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, _note_signal)
    if not args.no_supervise:
        argv = list(sys.argv[1:] if argv is None else argv)
        return supervise(args.engine, [*argv, "--engine", str(args.engine), "--no-supervise"])
    from megatron_rl.platform import exit_with_parent

    exit_with_parent()  # a supervisor killed with SIGKILL takes its engine process along
    try:
        address = args.connect or serve.address_from_env()
        authkey = serve.authkey_from_env()
        timeout = args.connect_timeout or serve.seconds_from_env(
            serve.CONNECT_TIMEOUT_ENV, serve.DEFAULT_CONNECT_TIMEOUT
        )
        logger.info("engine %d: connecting to the trainer at %s:%d", args.engine, *address)
        link = serve.connect(address, authkey, timeout)
    except (ValueError, ConnectionError) as err:
        logger.error("engine %d: %s", args.engine, err)
        return 2
    try:
        status = serve.serve_engine(link, args.engine)
    finally:
        link.close()
    logger.info("engine %d: exiting with status %d", args.engine, status)
    return status


def supervise(engine: int, child_args: list[str]) -> int:
    """Run the engine process (``python -m megatron_rl.launch.generator CHILD_ARGS``) until
    it exits with a status; start it again each time a signal kills it. Returns its status."""
    command = [sys.executable, "-m", "megatron_rl.launch.generator", *child_args]
    starts = 0
    while True:
        # Its own process group: what it leaves behind (vLLM workers) goes with it.
        child = subprocess.Popen(command, process_group=0)
        starts += 1
        logger.info(
            "engine %d: engine process pid %d started (start %d)", engine, child.pid, starts
        )
        status = child.wait()
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if status >= 0:
            return status
        logger.warning(
            "engine %d: engine process pid %d was killed by %s: starting it again on the same "
            "devices (the trainer decides whether it may: rollout.engine_max_restarts)",
            engine,
            child.pid,
            signal.Signals(-status).name,
        )


if __name__ == "__main__":
    sys.exit(main())

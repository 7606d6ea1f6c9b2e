"""The pool's listening socket for remote engines (``rollout.placement: remote``).

Engine tasks connect to ``$MEGATRON_RL_GENERATOR_ADDR``'s port: the connection is
authenticated with the job's key (``$MEGATRON_RL_GENERATOR_KEY``: only tasks of the job that
know it get in), then the task says :class:`~megatron_rl.rollout.messages.Hello` with its
engine index and is sent its :class:`~megatron_rl.rollout.messages.Init` (or a ``Reject``: an
index out of range or taken). What the pool does with an accepted connection (its handle,
:class:`~megatron_rl.rollout.pool.remote.RemoteEngine`) is the caller's: :mod:`.remote`.
"""

from __future__ import annotations

import logging
import pickle
import socket
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any, TypeVar

from megatron_rl.rollout.messages import Hello, Init, Reject
from megatron_rl.rollout.wire import (
    CONNECT_TIMEOUT_ENV,
    DEFAULT_CONNECT_TIMEOUT,
    Link,
    address_from_env,
    authkey_from_env,
    seconds_from_env,
)

logger = logging.getLogger(__name__)

H = TypeVar("H")  # what the caller makes of a connected engine task (its handle)


class Listener:
    """The pool's listening socket (``$MEGATRON_RL_GENERATOR_ADDR``'s port): authenticated
    engine tasks that say :class:`Hello` with an index in ``0..count-1``."""

    def __init__(self, count: int) -> None:
        _, port = address_from_env()
        self.count = count
        self.port = port
        self._authkey = authkey_from_env()
        self._server = socket.create_server(("", port), backlog=count + 8)

    def hello(self, deadline: float) -> tuple[int, Link, dict[str, Any]] | None:
        """The next engine task's (index, link, peer); None for a connection refused (not a
        task of this job) or rejected (bad index). Raises TimeoutError at the deadline."""
        try:
            conn = _accept(self._server, self._authkey, deadline)
        except TimeoutError:
            raise
        except (AuthenticationError, EOFError, OSError) as err:  # not a task of this job
            if self._server.fileno() < 0:  # closed
                raise
            logger.warning("generator connection refused: %s: %s", type(err).__name__, err)
            return None
        link = Link(conn)
        try:
            hello = link.recv()
        except (EOFError, OSError, pickle.UnpicklingError) as err:
            logger.warning("generator connection closed before its hello: %s", err)
            link.close()
            return None
        index = hello.engine if isinstance(hello, Hello) else -1
        if not 0 <= index < self.count:
            self.reject(link, index)
            return None
        return index, link, hello.peer

    def reject(self, link: Link, index: int) -> None:
        reason = f"engine index {index} is not one of 0..{self.count - 1} or is taken"
        link.send(Reject(reason))
        link.close()
        logger.error("generator connection rejected: %s", reason)

    def accept_all(
        self, init: Init, connected: Callable[[int, Link, dict[str, Any]], H]
    ) -> list[H]:
        """Engine tasks 0..count-1, each sent ``init`` and handed to ``connected(index, link,
        peer)`` as it arrives; returns what that made, by index. Raises RuntimeError naming
        the missing engines when they do not all connect within
        ``$MEGATRON_RL_GENERATOR_CONNECT_TIMEOUT`` seconds."""
        timeout = seconds_from_env(CONNECT_TIMEOUT_ENV, DEFAULT_CONNECT_TIMEOUT)
        deadline = time.monotonic() + timeout
        engines: dict[int, H] = {}
        logger.info("waiting for %d generator engine(s) on port %d", self.count, self.port)
        while len(engines) < self.count:
            try:
                got = self.hello(deadline)
            except TimeoutError:
                missing = sorted(set(range(self.count)) - set(engines))
                raise RuntimeError(
                    f"generator engine(s) {missing} did not connect within {timeout:.0f} s "
                    f"(${CONNECT_TIMEOUT_ENV}); see the generator log"
                ) from None
            if got is None:
                continue
            index, link, peer = got
            if index in engines:
                self.reject(link, index)
                continue
            link.send(init)
            engines[index] = connected(index, link, peer)
            logger.info("generator engine %d connected from %s", index, peer.get("host"))
        return [engines[i] for i in range(self.count)]

    def close(self) -> None:
        self._server.close()


def _accept(server: socket.socket, authkey: bytes, deadline: float) -> Connection:
    """The next authenticated connection (what ``Listener.accept`` does, with a deadline)."""
    server.settimeout(max(deadline - time.monotonic(), 1e-3))
    sock, _ = server.accept()  # TimeoutError at the deadline
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn

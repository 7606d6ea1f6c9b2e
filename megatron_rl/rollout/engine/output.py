"""An engine process's output: copied into a log file whose tail names the cause of a death."""

from __future__ import annotations

import os
import threading
from pathlib import Path

_READ_BYTES = 1 << 20  # a line longer than this is written in parts


def tee_output(log_path: str) -> None:
    """Copy everything this process writes to stdout and stderr (file descriptors 1 and 2:
    Python, vLLM and C++ alike) into ``log_path`` too. Threads copy; the log gets whole
    lines (ended by a newline or a carriage return: progress bars), so that the two streams
    never splice inside a line; what a killed process wrote up to its last line end is in
    the file."""
    log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    lock = threading.Lock()
    for fd in (1, 2):
        read_end, write_end = os.pipe()
        original = os.dup(fd)
        os.dup2(write_end, fd)
        os.close(write_end)

        def copy(read_end: int = read_end, original: int = original) -> None:
            partial = b""
            while data := os.read(read_end, 65536):
                os.write(original, data)
                partial += data
                end = max(partial.rfind(b"\n"), partial.rfind(b"\r")) + 1
                if not end and len(partial) > _READ_BYTES:  # no line end for that long
                    end = len(partial)
                if end:
                    with lock:
                        log.write(partial[:end])
                    partial = partial[end:]
            if partial:
                with lock:
                    log.write(partial)

        threading.Thread(target=copy, name=f"tee-{fd}", daemon=True).start()


def log_tail(log_path: str | None, lines: int = 20) -> str:
    """The last ``lines`` lines of an engine's log ("" when there is none)."""
    if not log_path or not Path(log_path).exists():
        return ""
    with open(log_path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])

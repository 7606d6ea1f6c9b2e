"""Process-wide OpenMP policy, set before torch is imported.

A trainer and its vLLM engines share the host's cores (on a CPU machine: all of them). With
libgomp's default wait policy each idle OpenMP thread spins for a while after a parallel
region; two processes that do so on the same cores take turns burning each other's time
slices. Measured on a 2-core machine with another process busy (torch 2.9, libgomp):
``rms_norm`` on [80, 32, 256] took 31-162 ms with 2 spinning threads against 3.6 ms with
``OMP_WAIT_POLICY=PASSIVE``; the tiny recipe's 40-step warm start took 33 s against 9 s.
The policy is read once, when libgomp loads (``import torch``), so it is set by the command
line entry point before anything imports torch, and inherited by every process it starts
(engines, reward workers, torchrun ranks). A value the user set is kept.
"""

from __future__ import annotations

import os

OMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}


def set_omp_defaults(environ: dict | None = None) -> None:
    """Set :data:`OMP_DEFAULTS` in ``environ`` (default ``os.environ``) where not already set."""
    environ = os.environ if environ is None else environ
    for key, value in OMP_DEFAULTS.items():
        environ.setdefault(key, value)

"""Per-GPU memory plans of a recipe: will the trainer and the engines fit, and what to change.

``plan_run(config)`` (``plan.py``) combines the model's shapes (``shapes.py``), megatron's
weight / gradient / optimizer layout (``states.py``), activations (``activations.py``) and
the vLLM engines' memory (``engine.py``) against a GPU (``gpus.py``); ``report.py`` prints it
and ``cli.py`` is ``megatron-rl plan``. Nothing here imports torch.

``plan.py`` is imported on first use of its names: loading a recipe reads the GPU table
(``gpus.py``, ``cluster.gpu``) and must not import numpy (``states.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.lazy import lazy_exports

__all__ = ["Layout", "Plan", "plan_run"]
_LAZY = {name: "megatron_rl.planning.plan" for name in __all__}

if TYPE_CHECKING:
    from megatron_rl.planning.plan import Layout, Plan, plan_run

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

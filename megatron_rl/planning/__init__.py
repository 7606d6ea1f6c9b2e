"""Per-GPU memory plans of a recipe: will the trainer and the engines fit, and what to change.

``plan_run(config)`` (``plan.py``) combines the model's shapes (``shapes.py``), megatron's
weight / gradient / optimizer layout (``states.py``), activations (``activations.py``) and
the vLLM engines' memory (``engine.py``) against a GPU (``gpus.py``); ``report.py`` prints it
and ``cli.py`` is ``megatron-rl plan``. Nothing here imports torch.
"""

from megatron_rl.planning.plan import Layout, Plan, plan_run

__all__ = ["Layout", "Plan", "plan_run"]

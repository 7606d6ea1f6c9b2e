"""Cluster-scale simulation of a recipe on the real scheduling code (no torch import).

``run.simulate`` drives the real ``trainer.rollout_source.RolloutSource`` with emulated engines
(``engines.py``), an emulated trainer and a simulated clock; every time comes from the cost
model in ``costs.py``, every length from the length model in ``workload.py``;
``report.py`` prints tables and plots utilisation vs k. ``tools/simulate_run.py`` is the CLI.
"""

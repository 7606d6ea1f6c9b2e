"""Cluster-scale simulation of a recipe on the real scheduling code (no torch import).

``run.simulate`` drives the real ``trainer.rollout_source.RolloutSource`` with emulated engines
(``engines.py``), an emulated trainer and a simulated clock; every time comes from the cost
model in ``costs.py``, every length from the length model in ``workload.py``;
``report.py`` prints tables and plots utilisation vs k. ``calibration.py`` reproduces published
RL runs and fits the expected model's factors (``costs.CALIBRATED``); ``predict.py`` gives a
recipe's physical limit, expected cost with a range, and issue 31's what-if switches.
``tools/simulate_run.py`` is the CLI.
"""

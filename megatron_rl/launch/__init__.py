"""Slurm launch of a run: one sbatch job with a trainer step and a generator step.

- :mod:`megatron_rl.launch.layout`: which tasks, nodes and GPUs each role gets, from the
  recipe's ``cluster`` section (no torch import).
- :mod:`megatron_rl.launch.render`: the sbatch script, rendered from
  :mod:`megatron_rl.launch.template`; ``python -m megatron_rl.launch.render --write``
  regenerates the checked-in scripts in ``slurm/``.
- :mod:`megatron_rl.launch.cli`: ``megatron-rl launch RECIPE [overrides] [--dry-run]``.
- :mod:`megatron_rl.launch.generator`: the generator role as its own Slurm task
  (``rollout.placement: remote``): it serves one engine of the pool
  (:mod:`megatron_rl.rollout.engine.serve`), reached by the trainer over TCP.
"""

"""Recipe tournaments (``megatron-rl tournament SPEC.yaml``): variants of a base recipe run
from one shared start, fitted as their validations arrive, losers stopped early, ranked and
predicted at a target budget. ``spec``: the spec and its plan; ``judge``: fits, the early-stop
rule, the table and the plot; ``runner``: local processes or Slurm jobs, resumable. No torch.
"""

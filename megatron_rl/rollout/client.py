"""What the trainer needs of a rollout pool, whichever runs it.

:class:`WeightsNeeded` is raised to the trainer loop when restarted engines wait for the
current weights, which only the trainer can send (all its ranks stream them together).
"""

from __future__ import annotations


class WeightsNeeded(Exception):
    """Restarted engines are ready and wait for the current weights
    (``GeneratorPool.reweigh``); raised where waiting for samples could otherwise last
    until the next regular push (forever, when no engine runs the current weights)."""

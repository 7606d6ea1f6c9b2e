"""The pool's side: the trainer's :class:`GeneratorPool` and what it runs its engines with.

- :mod:`.generator_pool`: :class:`GeneratorPool`, the front;
- :mod:`.launchers`: an engine handle and launcher per placement (thread, process);
- :mod:`.remote`: the pool's end of remote engines (``placement: remote``);
- :mod:`.fanout`: a push's buckets to every engine at the same time;
- :mod:`.restarts`: how often a dead engine may be restarted.
"""

from megatron_rl.rollout.pool.generator_pool import GeneratorPool

__all__ = ["GeneratorPool"]

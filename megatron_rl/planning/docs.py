"""Plans in the documentation, written by the planner itself (``tools/gen_docs.py``).

A page marks each plan it shows with the command that makes it::

    <!-- plan: recipes/scalerl_8b.yaml --gpu h100 rollout.kv_cache_gb=40 -->
    ... the output of `megatron-rl plan ... --markdown` ...
    <!-- end plan -->

:func:`refresh_plans` rewrites every marked block from the planner, so a figure in the docs
is the figure the tool prints today (``tests/unit/project/test_docs.py`` fails when one is
stale). Options inside a marker: ``--gpu NAME``, ``--alternatives N`` and ``key=value``
overrides, as on the command line. No torch import.
"""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"(<!-- plan: (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- end plan -->)", re.S)


def plan_markdown(root: Path, args: str) -> str:
    """``megatron-rl plan ARGS --markdown``'s text (ARGS: a recipe relative to ``root``,
    then ``--gpu``, ``--alternatives`` and overrides)."""
    from megatron_rl.config import load_run_config
    from megatron_rl.planning.plan import plan_run
    from megatron_rl.planning.report import markdown

    words = args.split()
    recipe, rest = words[0], words[1:]
    gpu, alternatives, overrides = None, 5, []
    while rest:
        word = rest.pop(0)
        if word == "--gpu":
            gpu = rest.pop(0)
        elif word == "--alternatives":
            alternatives = int(rest.pop(0))
        elif word.startswith("--"):
            raise ValueError(f"plan marker {args!r}: unknown option {word}")
        else:
            overrides.append(word)
    config = load_run_config(root / recipe, overrides)
    plan = plan_run(config, gpu=gpu or config.cluster.gpu)
    return markdown(plan, alternatives)


def refresh_plans(text: str, root: Path) -> str:
    """``text`` with every marked plan block rewritten by the planner."""

    def block(m: re.Match) -> str:
        body = plan_markdown(root, m.group("args")).rstrip("\n") + "\n"
        return f"{m.group(1)}\n{body}\n{m.group(4)}"

    return _BLOCK.sub(block, text)

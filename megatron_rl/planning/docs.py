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
_TABLE = re.compile(
    r"(<!-- plan-table: (?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- end plan-table -->)", re.S
)
TABLE_GPUS = ("gb200", "h200", "h100")


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


def fit_table(root: Path, recipes: list[str]) -> str:
    """Markdown: every recipe on every GPU of :data:`TABLE_GPUS`: trainer and engine GiB
    with their headroom, and the overrides that make both fit (the planner's smallest trainer
    layout change and its engine fix)."""
    from megatron_rl.config import load_run_config
    from megatron_rl.config.checks import fp8_recipe_problem, rollout_quantization_problem
    from megatron_rl.planning.gpus import GPUS
    from megatron_rl.planning.plan import plan_run
    from megatron_rl.planning.report import gb

    lines = [
        "| recipe | GPU | trainer GiB (headroom) | engine GiB (headroom) | to fit |",
        "|---|---|---:|---:|---|",
    ]
    for recipe in recipes:
        config = load_run_config(root / recipe)
        for gpu in TABLE_GPUS:
            refused = fp8_recipe_problem(config.model, f"--gpu {gpu}", GPUS[gpu].fp8_recipes)
            refused = refused or rollout_quantization_problem(
                config, f"--gpu {gpu}", GPUS[gpu].capability
            )
            if refused:
                lines.append(f"| {Path(recipe).stem} | {gpu} | | | refused: {refused} |")
                continue
            plan = plan_run(config, gpu=gpu)
            fixes = []
            if not plan.trainer_fits:
                s = plan.suggestion
                fixes += (
                    [
                        f"`{k}={_yaml(v)}`"
                        for k, v in s.layout.changes_from(plan.trainer.layout).items()
                    ]
                    if s is not None
                    else ["no layout of the trainer fits"]
                )
            if not plan.engine_fits:
                fixes += (
                    [f"`{c}`" for c in plan.engine_fix[0]]
                    if plan.engine_fix is not None
                    else ["no engine change tried fits"]
                )
            t, e = plan.trainer, plan.engine
            lines.append(
                f"| {Path(recipe).stem} | {plan.gpu.name} | {gb(t.total)} ({t.headroom:.0%}) | "
                f"{gb(e.total)} ({e.headroom:.0%}) | {' '.join(fixes) or 'fits as is'} |"
            )
    return "\n".join(lines) + "\n"


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def refresh_plans(text: str, root: Path) -> str:
    """``text`` with every marked plan block (and plan table) rewritten by the planner."""

    def block(m: re.Match) -> str:
        body = plan_markdown(root, m.group("args")).rstrip("\n") + "\n"
        return f"{m.group(1)}\n{body}\n{m.group(4)}"

    def table(m: re.Match) -> str:
        return f"{m.group(1)}\n{fit_table(root, m.group('args').split())}\n{m.group(4)}"

    return _TABLE.sub(table, _BLOCK.sub(block, text))

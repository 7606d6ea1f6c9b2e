"""Rewards by name: the built-ins (``math``, ``code``) and those of installed packages.

A package adds a reward for single-turn tasks with an entry point in the group
``megatron_rl.rewards`` naming a function ``score(answer, reference) -> bool | float``::

    entry_points={"megatron_rl.rewards": ["my_reward = my_pkg.rewards:score"]}

``answer`` is the response's text after the thinking (``reward.think_end_tag``; a response
without it when ``reward.require_think_end`` is set scores ``reward.incorrect_reward`` without
a call), ``reference`` the prompt's ``answer`` field. ``True`` / ``False`` score
``reward.correct_reward`` / ``reward.incorrect_reward``; a float is the reward itself and must
lie between the two. A recipe uses it by name as its data's ``domain`` (``data.domain``, or a
mixture source's); its validation pass rate is ``val_pass_rate/<name>`` in a mixture.

Where it runs: in the reward's worker processes (``reward.num_workers``), under the same
limits as math verification (CPU time ``reward.timeout_s``, memory, no process creation, no
network, no file writes), so a slow or crashing scorer costs its item alone. The function is
imported by module and name in each worker (an entry point's ``module:function``).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

ENTRY_POINT_GROUP = "megatron_rl.rewards"
BUILTIN: tuple[str, ...] = ("math", "code")


def registered() -> dict[str, str]:
    """The installed reward plug-ins: name -> "module:function". A plug-in may not take a
    built-in's name (a silent swap of ``math`` would change what every recipe pays for)."""
    found = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN:
            raise ValueError(
                f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}) reuses the name of "
                "a built-in reward"
            )
        found[ep.name] = ep.value
    return found


def kinds() -> list[str]:
    """Every reward kind a recipe may name: the built-ins, then the plug-ins, sorted."""
    return [*BUILTIN, *sorted(registered())]


_LOADED: dict[str, Callable[[str, Any], Any]] = {}


def load(value: str) -> Callable[[str, Any], Any]:
    """The function ``value`` ("module:function") names, imported once per process."""
    if value not in _LOADED:
        target = EntryPoint("", value, ENTRY_POINT_GROUP).load()
        if not callable(target):
            raise TypeError(f"reward plug-in {value} is not callable")
        _LOADED[value] = target
    return _LOADED[value]


def score(value: str, answer: str, reference: Any, correct: float, incorrect: float) -> float:
    """The reward of ``answer`` by the plug-in ``value``; runs in a reward worker. Raises
    (an ``error`` of this item) on a result that is not a bool or a finite float in
    [incorrect, correct] (numpy scalars count as their Python values)."""
    result = load(value)(answer, reference)
    if type(result).__module__ == "numpy" and callable(getattr(result, "item", None)):
        # A numpy scalar (``np.isclose(a, b)``, ``abs(x - y) < tol`` on numpy floats: an
        # np.bool_, which is no bool): its Python value. An array stays refused.
        if getattr(result, "shape", None) == ():
            result = result.item()
    if isinstance(result, bool):
        return correct if result else incorrect
    if isinstance(result, (int, float)) and math.isfinite(result):
        low, high = min(incorrect, correct), max(incorrect, correct)
        if low <= float(result) <= high:
            return float(result)
    raise ValueError(
        f"reward plug-in {value} returned {result!r}: expected a bool or a number in "
        f"[{incorrect:g}, {correct:g}]"
    )


def module_of(value: str) -> str:
    """The module a plug-in's value names (for an import check at load)."""
    return value.partition(":")[0]


def check_importable(name: str) -> None:
    """Raise ValueError naming ``name`` when its plug-in's module does not import."""
    value = registered()[name]
    try:
        importlib.import_module(module_of(value))
    except Exception as err:  # noqa: BLE001 - any import failure, named
        raise ValueError(f"reward plug-in {name} = {value} does not import: {err}") from None

"""Lazy package exports (PEP 562): a package names what it exports and from which module,
and each name is imported on first use, so that importing the package (the config schema,
say) stays light. One mechanism for every package's ``__init__``."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any


class _ReadThrough(types.ModuleType):
    """A package whose exports are read from their defining modules at every use
    (``cache=False``): setting one on the package would shadow that module for good (a
    test's ``monkeypatch.setattr(package, name, ...)`` leaves the original behind as a
    package attribute on undo, and later patches of the defining module are then not seen by
    ``from package import name``). Refused, naming where to set it."""

    def __setattr__(self, name: str, value: Any) -> None:
        exports = self.__dict__.get("_read_through", {})
        if name in exports:
            raise AttributeError(
                f"{self.__name__}.{name} is read from {exports[name]} at every use: set "
                f"{exports[name]}.{name} instead"
            )
        super().__setattr__(name, value)


def lazy_exports(
    namespace: dict[str, Any], exports: Mapping[str, str], cache: bool = True
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is
    ``namespace``: ``exports`` maps each public name to its defining module. ``cache``: keep
    a loaded name in the package (off: every access reads the defining module's current
    value, and setting the name on the package is refused: ``_ReadThrough``)."""
    package = namespace["__name__"]
    if not cache:  # the package is in sys.modules while its __init__ runs
        namespace["_read_through"] = dict(exports)
        sys.modules[package].__class__ = _ReadThrough

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        if cache:
            namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__

"""Typed config trees from YAML recipes: strict parsing with dotted key paths in every error.

A recipe is a YAML mapping mirrored by a tree of dataclasses. A recipe may name a ``base``
recipe (a path relative to itself) that it extends; mappings merge recursively, everything
else is replaced. Command-line overrides ``dotted.key=value`` are applied last, values parsed
as YAML scalars. Unknown keys, wrong types and failed ``validate()`` checks raise
:class:`ConfigError` carrying the key path. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from megatron_rl.config.errors import ConfigError

T = TypeVar("T")


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML recipe and merge it over its ``base`` chain. Returns a plain dict."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: 'base' chain loops back to this file")
    if not path.is_file():
        raise ConfigError(f"recipe file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ConfigError(
            f"{path} line {line}: not UTF-8 text (byte {raw[err.start]:#04x}); save the "
            "recipe as UTF-8"
        ) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping, got {type(data).__name__}")
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: 'base' must be a path string")
    parent = read_recipe(path.parent / base, (*_seen, path))
    return merge(parent, data)


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge ``update`` over ``base`` (mappings merge, other values replace)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as a YAML scalar or flow collection)."""
    data = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r}: expected dotted.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: '{'.'.join(parts[: i + 1])}' is not a section"
                )
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return data


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, strictly; then run every ``validate()``."""
    obj = _build(cls, data, path)
    _validate_tree(obj, path)
    return obj


def to_dict(obj: Any) -> Any:
    """A dataclass tree as plain YAML-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _error(path: str, message: str) -> ConfigError:
    """The error about recipe key ``path`` ("": the recipe's top level)."""
    return ConfigError(path, message) if path else ConfigError(f"recipe: {message}")


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _error(path, f"expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{path}.{unknown[0]}" if path else unknown[0]
        close = difflib.get_close_matches(unknown[0], fields, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise _error(key, f"unknown key; {hint}known keys here: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        key = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(hints[name], value, key)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise _error(path, str(err)) from None


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        raise _error(path, f"{value!r} fits none of {tp}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise _error(path, f"{value!r} is not one of {list(choices)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _error(path, f"expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise _error(path, f"expected {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _error(path, f"expected a mapping, got {type(value).__name__}")
        vt = get_args(tp)[1] if get_args(tp) else Any
        return {k: _coerce(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _error(path, f"expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "5e-7" (no dot) as a string; accept numeric strings.
            if isinstance(value, str):
                try:
                    number = float(value)
                except ValueError:
                    pass
                else:
                    return _coerce(float, number, path)
            raise _error(path, f"expected a number, got {value!r}")
        number = float(value)
        # NaN passes every `<= 0` check of the sections' validate() and inf overflows later
        # (a timedelta of inf minutes after the warm start): no key means either.
        if not math.isfinite(number):
            raise _error(path, f"expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            # YAML turns unquoted 12:30:00 into 45000 (base 60), yes/no into booleans ...
            hint = " (quote it in YAML)" if isinstance(value, (int, float, bool)) else ""
            raise _error(path, f"expected a string, got {value!r}{hint}")
        return value
    raise _error(path, f"unsupported field type {tp}")


def _validate_tree(obj: Any, path: str) -> None:
    """Run every ``validate()`` of the tree, children first. A section raises
    :class:`ConfigError` with the key relative to itself, completed here with its path; any
    other ``ValueError`` is reported against the section as a whole."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        key = f"{path}.{f.name}" if path else f.name
        _validate_tree(getattr(obj, f.name), key)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as err:
            raise err.within(path) from None
        except ValueError as err:
            raise _error(path, str(err)) from None

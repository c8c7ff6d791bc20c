"""Dataclass configs from YAML files and ``key=value`` overrides.

Nested dataclasses are addressed with dots (``optimizer.lr=1e-3``); values are parsed as YAML
scalars and checked against the field's type, so ``steps=abc`` fails with a message naming the
field instead of deep inside training.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where) for v in value]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {
        bool: isinstance(value, bool),
        int: number and isinstance(value, int),
        float: number,
        str: isinstance(value, str),
    }.get(tp, True)
    if not ok:
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return float(value) if tp is float else value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    types = _field_types(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown config keys {sorted(prefix + k for k in unknown)}; "
                         f"known: {sorted(prefix + n for n in names)}")
    kwargs = {k: _coerce(v, types[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """Return a copy of ``cfg`` with ``a.b=value`` overrides applied."""
    data = to_dict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw else ""
        node = data
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                raise ValueError(f"override {key!r}: {p!r} is not a config section")
            node = node[p]
        if parts[-1] not in node:
            raise ValueError(f"override {key!r}: unknown key; known here: {sorted(node)}")
        node[parts[-1]] = value
    return from_dict(type(cfg), data)


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    cfg = cls()
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ValueError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {path} must hold a mapping of keys to values")
        cfg = from_dict(cls, data)
    return apply_overrides(cfg, overrides or [])

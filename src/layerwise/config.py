"""Dataclass configs from defaults, YAML files and ``key=value`` overrides: typed, documented,
discoverable.

Sections are addressed with dots (``optimizer.lr=1e-3``); each field's documentation is the
string literal under it, so ``--help`` shows the text a reader sees. YAML goes through the same
value parsing (PyYAML reads ``1e-3`` as a string). Hooks: ``shorthand`` (``model=DIR``) and
``removed_keys`` (refused in one line naming the new key). Misspellings get the closest known."""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import functools
import inspect
import re
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_NONE = ("none", "null", "~")


# ----- documentation and keys -------------------------------------------------------------


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal right under it), whitespace collapsed."""
    node = _class_nodes(getattr(inspect.getmodule(cls), "__file__", None)).get(cls.__qualname__)
    if node is None:
        return {}
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@functools.cache
def _class_nodes(filename: str | None) -> dict[str, ast.ClassDef]:
    """Qualified name -> class node of a module's source, parsed once per module
    (``inspect.getsource`` parses the whole module again for every class: nine for ``train
    --help``, most of its time)."""
    try:
        tree = ast.parse(Path(filename).read_text(encoding="utf-8"))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError, UnicodeDecodeError):
        return {}
    out: dict[str, ast.ClassDef] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                out[prefix + stmt.name] = stmt
                visit(stmt.body, prefix + stmt.name + ".")

    visit(tree.body, "")
    return out


@functools.cache
def _types(cls: type) -> dict[str, Any]:
    """The settable fields' types (``metadata={"cli": False}``: a library's field, not one)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in _fields(cls)}


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Key:
    """One settable key of a config (a leaf field), for help and suggestions."""

    name: str
    """Dotted: ``optimizer.lr``."""
    type: Any
    default: Any
    doc: str
    choices: tuple | None


def keys(cls: type, prefix: str = "", instance: Any = None) -> list[Key]:
    """Every leaf key of ``cls``, sections expanded, in declaration order; defaults from
    ``instance`` when given (a section's default is its parent's default of the section)."""
    out: list[Key] = []
    hints, docs = _types(cls), field_docs(cls)
    for f in _fields(cls):
        tp = hints[f.name]
        default = getattr(instance, f.name) if instance is not None else _default(f)
        if dataclasses.is_dataclass(tp):
            out.extend(keys(tp, prefix + f.name + ".", default))
        else:
            out.append(Key(prefix + f.name, tp, default, docs.get(f.name, ""),
                           f.metadata.get("choices")))
    return out


def sections(cls: type) -> dict[str, type]:
    """Top-level section name -> its dataclass."""
    hints = _types(cls)
    return {f.name: hints[f.name] for f in _fields(cls)
            if dataclasses.is_dataclass(hints[f.name])}


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def show_value(value: Any) -> str:
    """A value as one would type it after ``key=``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    if isinstance(value, int) and abs(value) >= 10_000:
        return f"{value:_}"
    return str(value)


def suggest(word: str, known: list[str]) -> str:
    """``; did you mean 'x'?`` for the closest known words (empty when none is close)."""
    close = difflib.get_close_matches(word, known, n=3, cutoff=0.6)
    if not close and "." in word:  # a right field under the wrong section
        leaf = word.rsplit(".", 1)[1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf][:3]
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


# ----- parsing values ---------------------------------------------------------------------


def _parse_number(value: Any, tp: type, where: str) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{where}: expected {tp.__name__}, got {show_value(value)}")
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text) if tp is int else float(text)
        except ValueError:
            try:
                value = float(text)  # an int written 1e3
            except ValueError:
                what = "int (e.g. 100 or 1_000)" if tp is int else "float (e.g. 1e-3)"
                raise ValueError(f"{where}: expected {what}, got {text!r}") from None
    if not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    if tp is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{where}: expected int, got {value!r}")
        return int(value)
    return float(value)


def _parse_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{where}: expected true or false, got {value!r}")


def _parse_list(value: Any, tp: Any, where: str) -> list | tuple:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ValueError(f"{where}: {text!r} is not a list like [a, b]") from None
        else:
            value = [v.strip() for v in text.split(",") if v.strip()]
    elif not isinstance(value, (list, tuple)):
        value = [value]
    fixed = origin is tuple and args and args[-1] is not Ellipsis
    if fixed and len(value) != len(args):
        raise ValueError(f"{where}: expected {len(args)} values, got {len(value)}: {value!r}")
    inner = list(args) if fixed else [args[0] if args else Any] * len(value)
    items = [coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, inner))]
    return tuple(items) if origin is tuple else items


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` (a string from the command line, or what YAML made of a value) as type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str)
                                                     and value.strip().lower() in _NONE)):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else f"{where}: bad value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping of its keys, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if origin in (list, tuple):
        return _parse_list(value, tp, where)
    if tp is bool:
        return _parse_bool(value, where)
    if tp in (int, float):
        return _parse_number(value, tp, where)
    if tp is str:
        if isinstance(value, bool):
            return show_value(value)
        if isinstance(value, (int, float)):
            return str(value)
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected text, got {value!r}")
        return value
    return value  # Any, dict, ...


def _check_choice(value: Any, choices: tuple | None, where: str) -> None:
    if choices is None:
        return
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and v not in choices:
            raise ValueError(f"{where}={v!r}: use one of {', '.join(map(str, choices))}"
                             + suggest(str(v), [str(c) for c in choices]))


# ----- dicts, removed keys, shorthand ---------------------------------------------------------


def _known_keys(cls: type) -> list[str]:
    return [k.name for k in keys(cls)] + list(sections(cls))


def _unknown(key: str, cls: type) -> ValueError:
    return ValueError(f"unknown key {key!r}" + suggest(key, _known_keys(cls)))


def removed_key(key: str, value: Any, cls: type) -> str | None:
    """The line that refuses ``key=value`` (a dotted key, as ``_flatten`` gives) when ``key`` is
    an old one of ``cls.removed_keys``, naming today's; None for any other key."""
    head, _, rest = key.partition(".")
    new = getattr(cls, "removed_keys", {}).get(head)
    if new is None:
        return None
    if new.endswith(".*"):  # an old mapping: its keys are the section's fields
        new = new[:-1] + rest if rest else new[:-1] + "KEY"
        return f"{head} is gone: use {new}={show_value(value) if rest else 'VALUE'}"
    return f"{head} is gone: use {new}={show_value(value)}"


def _rename(key: str, value: Any, cls: type) -> str:
    """``key`` in today's names: an alias (``cls.aliases``: HF's names) to its key, a section's
    name alone to its shorthand field; an old key refused, naming its new one."""
    key = getattr(cls, "aliases", {}).get(key, key)
    gone = removed_key(key, value, cls)
    if gone is not None:
        raise ValueError(gone)
    sec = sections(cls)
    head, _, rest = key.partition(".")
    if head in sec and not rest:
        short = getattr(sec[head], "shorthand", None)
        if short is None:
            raise ValueError(f"{head} is a section: set its keys, e.g. "
                             f"{keys(sec[head], head + '.')[0].name}=VALUE")
        key = f"{head}.{short}"
    return key


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"a": {"b": 1}}`` -> ``[("a.b", 1)]``; a non-dict value stays a leaf."""
    out = []
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.extend(_flatten(v, f"{prefix}{k}."))
        else:
            out.append((f"{prefix}{k}", v))
    return out


def _set(data: dict, key: str, value: Any, cls: type) -> None:
    node, hints = data, _types(cls)
    parts = key.split(".")
    for p in parts[:-1]:
        if p not in hints or not dataclasses.is_dataclass(hints[p]):
            raise _unknown(key, cls)
        node = node.setdefault(p, {})
        hints = _types(hints[p])
    if parts[-1] not in hints or dataclasses.is_dataclass(hints[parts[-1]]):
        raise _unknown(key, cls)
    node[parts[-1]] = value


def normalize(cls: type, data: dict) -> dict:
    """A nested dict of today's keys from ``data`` (nested or dotted keys, section shorthands);
    unknown and old keys refused, the one with suggestions, the other naming its new key."""
    out: dict = {}
    for key, value in _flatten(data):
        new = _rename(key, value, cls)
        if isinstance(value, dict) and not value:
            continue
        _set(out, new, value, cls)
    return out


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """``cls`` from a nested dict of its fields (missing ones take their defaults)."""
    hints = _types(cls)
    fields = {f.name: f for f in _fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        known = [prefix + n for n in fields]
        raise ValueError(f"unknown key {prefix + unknown[0]!r}"
                         + suggest(prefix + unknown[0], known))
    kwargs = {}
    for k, v in data.items():
        value = coerce(v, hints[k], prefix + k)
        _check_choice(value, fields[k].metadata.get("choices"), prefix + k)
        kwargs[k] = value
    return cls(**kwargs)


def to_dict(obj: Any) -> dict[str, Any]:
    return {f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(obj, f.name))
            else copy.deepcopy(v) for f in _fields(type(obj))}


def merge(base: dict, top: dict) -> dict:
    """``top``'s keys over ``base``'s, section by section."""
    out = dict(base)
    for k, v in top.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_overrides(cls: type, overrides: list[str]) -> dict:
    """``["a.b=1", ...]`` as a nested dict of raw strings (typed by ``from_dict``)."""
    out: dict = {}
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{item!r} is not of the form key=value")
        _set(out, _rename(key.strip(), raw, cls), raw, cls)
    return out


def read_yaml(path: str | Path) -> dict:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ValueError(f"config file {path} does not exist") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys to values")
    return data


def build(cls: type[T], *layers: dict) -> T:
    """``cls`` from its defaults under ``layers`` (each a nested or dotted dict), later ones
    winning key by key."""
    data: dict = {}
    for layer in layers:
        data = merge(data, normalize(cls, layer))
    return from_dict(cls, data)


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """A copy of ``cfg`` with ``a.b=value`` overrides applied."""
    cls = type(cfg)
    return build(cls, to_dict(cfg), parse_overrides(cls, overrides))


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Defaults, then the YAML file at ``path``, then ``overrides``."""
    layers = [read_yaml(path)] if path is not None else []
    return build(cls, *layers, parse_overrides(cls, overrides or []))


# ----- help and printing -------------------------------------------------------------------


_SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])")


def _plain(doc: str) -> str:
    return doc.replace("``", "")


def _first_sentence(doc: str) -> str:
    m = _SENTENCE_END.search(doc)
    return doc[:m.start() + 1] if m else doc


def _label(name: str, cls: type) -> str:
    """``model`` for ``model.name`` when that is the section's shorthand."""
    head, _, rest = name.partition(".")
    sec = sections(cls).get(head)
    return head if sec is not None and getattr(sec, "shorthand", None) == rest else name


def help_text(cls: type, only: list[str] | None = None, full: bool = False,
              width: int = 100) -> str:
    """Keys with defaults and docs: ``only`` those keys (in that order), one sentence each;
    ``full``: every key grouped by section, with its whole docstring, type and choices."""
    all_keys = {k.name: k for k in keys(cls, instance=cls())}
    chosen = [all_keys[n] for n in only] if only is not None else list(all_keys.values())
    lines: list[str] = []
    section = None
    for k in chosen:
        left = f"  {_label(k.name, cls)}={show_value(k.default)}"
        if not full:
            doc = textwrap.wrap(_plain(_first_sentence(k.doc)), width - 34) or [""]
            lines.append(f"{left:<33} {doc[0]}" if len(left) < 33 else left)
            lines.extend(" " * 34 + d for d in (doc[1:] if len(left) < 33 else doc))
            continue
        sec = k.name.split(".")[0] if "." in k.name else ""
        if sec != section:
            section = sec
            lines += ["", f"[{sec}]" if sec else "[run]"]
        lines.append(left)
        extra = f" ({type_name(k.type)}"
        extra += f"; one of {', '.join(map(str, k.choices))})" if k.choices else ")"
        lines.extend("      " + line for line in textwrap.wrap(_plain(k.doc) + extra, width - 6))
    return "\n".join(lines).lstrip("\n")


def to_yaml(cfg: Any) -> str:
    """The config as YAML that ``--config`` reads back."""
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    return yaml.safe_dump(plain(to_dict(cfg)), sort_keys=False, default_flow_style=False)

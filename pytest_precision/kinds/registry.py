"""The registries of kinds and of targets (the callables the suites test).

Kinds: the built-in ones (softmax, log_softmax, attention, train_step) and those a project adds,
with ``pytest_precision.register_kind(kind)`` in a ``conftest.py``, an ini line
``precision_kinds = package.module:KIND``, or an entry point in the ``pytest_precision.kinds``
group. A kind is named by an import path and loaded the first time it is needed.

Targets: ``pytest_precision.register("name", fn, kind="softmax")`` (or as a decorator) in a
``conftest.py``, or ini lines ``precision_targets = package.module:function kind``.
"""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Callable

from .base import Kind
from .target import Target, TargetError

__all__ = ["Target", "TargetError", "BUILTIN_KINDS", "ENTRY_POINT_GROUP", "register_kind", "get_kind", "kinds",
           "kind_names", "forget_project_kinds", "register", "registered", "clear", "parse_ini_targets",
           "parse_ini_kinds", "resolve"]

# name -> import path of the kind object; imported when first needed
BUILTIN_KINDS = {
    "softmax": "pytest_precision.suites.softmax:SOFTMAX",
    "log_softmax": "pytest_precision.suites.softmax:LOG_SOFTMAX",
    "attention": "pytest_precision.suites.attention:ATTENTION",
    "train_step": "pytest_precision.suites.training:TRAIN_STEP",
}
ENTRY_POINT_GROUP = "pytest_precision.kinds"

_PATHS: dict[str, str] = {}  # kinds known by import path, not imported yet
_KINDS: dict[str, Kind] = {}  # loaded kinds, in order
_PROJECT: set[str] = set()  # kinds a project registered in this session (forgotten between sessions)
_discovered = False


def resolve(path: str) -> Any:
    """The object at ``package.module:attr`` (attr may be dotted)."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for a in filter(None, attr.split(".")):
        obj = getattr(obj, a)
    return obj


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for name, path in BUILTIN_KINDS.items():
        _PATHS.setdefault(name, path)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        _PATHS.setdefault(ep.name, ep.value)


def _load(name: str) -> Kind:
    path = _PATHS.pop(name)
    try:
        kind = resolve(path)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"kind {name!r}: cannot import {path!r}: {e}") from e
    if not isinstance(kind, Kind):
        raise ValueError(f"kind {name!r}: {path!r} is a {type(kind).__name__}, not a pytest_precision.Kind")
    if kind.name != name:
        raise ValueError(f"kind {name!r}: {path!r} is the kind {kind.name!r}")
    _KINDS[name] = kind
    return kind


def register_kind(kind: "Kind | str") -> Kind:
    """Add a kind (an instance, or the import path of one) to this session's kinds."""
    _discover()
    if isinstance(kind, str):
        kind = resolve(kind)
    if not isinstance(kind, Kind):
        raise TypeError(f"register_kind: {kind!r} is not a pytest_precision.Kind")
    if not kind.name:
        raise ValueError(f"register_kind: {kind!r} has no name")
    old = _KINDS.get(kind.name)
    if old is kind:
        return kind
    if kind.name in BUILTIN_KINDS or (kind.name in _PATHS or old is not None) and kind.name not in _PROJECT:
        raise ValueError(f"kind {kind.name!r} is the name of a built-in or installed kind; give yours another name")
    if old is not None:
        raise ValueError(f"kind {kind.name!r} is already registered ({old!r})")
    _KINDS[kind.name] = kind
    _PROJECT.add(kind.name)
    return kind


def get_kind(name: str) -> Kind:
    _discover()
    if name in _KINDS:
        return _KINDS[name]
    if name in _PATHS:
        return _load(name)
    raise ValueError(f"unknown kind {name!r}; known kinds: {', '.join(kind_names())}")


def kind_names() -> list[str]:
    _discover()
    return [*BUILTIN_KINDS, *(n for n in (*_KINDS, *_PATHS) if n not in BUILTIN_KINDS)]


def kinds() -> list[Kind]:
    """Every kind, loaded: the built-in ones first, then installed and registered ones."""
    return [get_kind(n) for n in dict.fromkeys(kind_names())]


def forget_project_kinds() -> None:
    """Drop the kinds registered during a session (pytester runs several in one process)."""
    for name in _PROJECT:
        _KINDS.pop(name, None)
    _PROJECT.clear()


def parse_ini_kinds(lines: list[str]) -> list[Kind]:
    """Kinds from ini lines ``package.module:KIND``."""
    out = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if ":" not in line or len(line.split()) != 1:
            raise ValueError(f"precision_kinds: cannot read {raw!r}; expected 'package.module:KIND'")
        try:
            out.append(register_kind(line))
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"precision_kinds: {line!r}: {e}") from e
    return out


# ---- targets ---------------------------------------------------------------------------------

_REGISTRY: dict[str, Target] = {}


def register(name: str, fn: Callable | None = None, *, kind: str = "softmax"):
    """Register ``fn`` as a target called ``name``; without ``fn``, a decorator."""
    try:
        k = get_kind(kind)
    except ValueError as e:
        raise ValueError(f"target {name!r}: {e}") from None

    def add(f: Callable) -> Callable:
        k.check_target(name, f)
        old = _REGISTRY.get(name)
        if old is not None and old.fn is not f:
            raise ValueError(f"target name {name!r} is already registered (by {old.origin}) for another callable")
        _REGISTRY[name] = Target(name, f, kind, origin=getattr(f, "__module__", "?") or "?")
        return f

    return add(fn) if fn is not None else add


def registered(kind: str | None = None) -> list[Target]:
    """Registered targets, in registration order, optionally of one kind."""
    return [t for t in _REGISTRY.values() if kind is None or t.kind == kind]


def clear() -> None:
    _REGISTRY.clear()


def parse_ini_targets(lines: list[str]) -> list[Target]:
    """Targets from ini lines ``package.module:function kind`` (kind defaults to softmax)."""
    out = []
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2 or ":" not in parts[0]:
            raise ValueError(f"precision_targets: cannot read {raw!r}; expected 'package.module:function kind'")
        spec, kind_name = parts[0], (parts[1] if len(parts) == 2 else "softmax")
        try:
            kind = get_kind(kind_name)
        except ValueError as e:
            raise ValueError(f"precision_targets: target {spec!r}: {e}") from None
        try:
            obj = resolve(spec)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"precision_targets: cannot import {spec!r}: {e}") from e
        try:
            kind.check_target(spec, obj)
        except TypeError as e:
            raise ValueError(f"precision_targets: {e}") from None
        out.append(Target(spec, obj, kind_name, origin="ini precision_targets"))
    return out

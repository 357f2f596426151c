"""The registries of kinds and of targets (the callables the suites test).

Kinds: the built-in ones (softmax, log_softmax, attention, layer_norm, rms_norm, cross_entropy,
op, train_step: ``BUILTIN_KINDS``) and those a project adds,
with ``pytest_precision.register_kind(kind)`` in a ``conftest.py``, an ini line
``precision_kinds = package.module:KIND``, or an entry point in the ``pytest_precision.kinds``
group. A kind is named by an import path and loaded the first time it is needed.

Targets: ``pytest_precision.register("name", fn, kind="softmax")`` (or as a decorator) in a
``conftest.py``, or ini lines ``precision_targets = package.module:function kind``.

One name, one file: a name (of a target, a kind, a regime) becomes a directory of the baseline
store and a token of pytest's ``-k`` expressions, so it is 1 to 100 ASCII letters, digits and
``_ . + -`` (an ini target's name is its ``module:function``), and two names that would share a
directory (told apart only by case, or ``:`` against ``_``) are refused with both names. A name
is one target: the same name under a second kind is refused too.

What a project registers belongs to one session: a :class:`Registry` (its targets and kinds), opened
when a pytest session starts reading its configuration and closed with it (``open_session`` /
``close_session``, from the plugin), so that a session run inside another (pytester's) neither sees
the outer one's registrations nor drops them. Registrations outside any session (a script that
registers and then calls ``pytest.main``, a plugin registering as it is imported) go to the
process's own registry, which every session sees beside its own. The kinds named by import path
(built-in and installed) are code, loaded once per process.
"""
from __future__ import annotations

import importlib
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

from ..baselines.store import file_component, name_problem, sanitize_key as sanitize
from .kind import Kind
from .target import Target, TargetError

__all__ = ["Target", "TargetError", "BUILTIN_KINDS", "ENTRY_POINT_GROUP", "Registry", "open_session", "close_session",
           "register_kind", "get_kind", "kinds", "kind_names", "forget_project_kinds", "register", "registered", "clear",
           "parse_ini_targets", "parse_ini_kinds", "resolve", "target_names_problem"]

# name -> import path of the kind object; imported when first needed
BUILTIN_KINDS = {
    "softmax": "pytest_precision.suites.softmax:SOFTMAX",
    "log_softmax": "pytest_precision.suites.softmax:LOG_SOFTMAX",
    "attention": "pytest_precision.suites.attention:ATTENTION",
    "train_step": "pytest_precision.suites.training:TRAIN_STEP",
    "layer_norm": "pytest_precision.suites.norm:LAYER_NORM",
    "rms_norm": "pytest_precision.suites.norm:RMS_NORM",
    "cross_entropy": "pytest_precision.suites.cross_entropy:CROSS_ENTROPY",
    "op": "pytest_precision.suites.op:OP",
}
ENTRY_POINT_GROUP = "pytest_precision.kinds"

_PATHS: dict[str, str] = {}  # kinds known by import path, not imported yet
_LOADED: dict[str, Kind] = {}  # kinds loaded from their import path, in order
_discovered = False


class Registry:
    """What one session registered: its targets and its project's kinds, in registration order."""

    def __init__(self):
        self.targets: dict[str, Target] = {}
        self.kinds: dict[str, Kind] = {}


_SESSIONS: list[Registry] = [Registry()]  # the process's own, then each open session's


def _current() -> Registry:
    return _SESSIONS[-1]


def open_session() -> Registry:
    """A new registry for a session starting (the plugin, before its conftests are imported)."""
    _SESSIONS.append(Registry())
    return _SESSIONS[-1]


def close_session(session: Registry) -> None:
    """Drop ``session``'s registry and any opened after it and left open (a session that ended
    before it was configured); the registrations of the one around it are current again."""
    if session in _SESSIONS[1:]:
        del _SESSIONS[_SESSIONS.index(session):]


def _visible() -> list[Registry]:
    """The registries a lookup reads: the current session's, then the process's own."""
    return [_current()] if len(_SESSIONS) == 1 else [_current(), _SESSIONS[0]]


def _visible_targets() -> dict[str, Target]:
    """The targets a session sees: the process's own, then its own, in registration order."""
    return {n: t for r in reversed(_visible()) for n, t in r.targets.items()}


def _known(name: str) -> Kind | None:
    return next((r.kinds[name] for r in _visible() if name in r.kinds), None) or _LOADED.get(name)


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
    _check_names(kind)
    _LOADED[name] = kind
    return kind


def _check_names(kind: Kind) -> None:
    """The kind's name and its regimes' names follow the rule of names (module docstring)."""
    problem = name_problem(kind.name)
    if problem:
        raise ValueError(f"kind name {problem}")
    for key, regime in kind.regimes.items():
        problem = name_problem(regime.name) or (None if key == regime.name else
                                                f"{key!r} names the regime {regime.name!r}")
        if problem:
            raise ValueError(f"kind {kind.name!r}: regime name {problem}")
    if kind.drawn is not None and name_problem(kind.drawn.name):
        raise ValueError(f"kind {kind.name!r}: regime name {name_problem(kind.drawn.name)}")
    folded = {}
    for name in kind.regime_names():
        other = folded.setdefault(file_component(name), name)
        if other != name:
            raise ValueError(f"kind {kind.name!r}: regime names {other!r} and {name!r} would share baseline files")


def register_kind(kind: "Kind | str") -> Kind:
    """Add a kind (an instance, or the import path of one) to this session's kinds."""
    _discover()
    if isinstance(kind, str):
        kind = resolve(kind)
    if not isinstance(kind, Kind):
        raise TypeError(f"register_kind: {kind!r} is not a pytest_precision.Kind")
    if not kind.name:
        raise ValueError(f"register_kind: {kind!r} has no name")
    old = _known(kind.name)
    if old is kind:
        return kind
    if kind.name in BUILTIN_KINDS or kind.name in _PATHS or kind.name in _LOADED:
        raise ValueError(f"kind {kind.name!r} is the name of a built-in or installed kind; give yours another name")
    if old is not None:
        raise ValueError(f"kind {kind.name!r} is already registered ({old!r})")
    _check_names(kind)
    _current().kinds[kind.name] = kind
    return kind


def get_kind(name: str) -> Kind:
    _discover()
    known = _known(name)
    if known is not None:
        return known
    if name in _PATHS:
        return _load(name)
    raise ValueError(f"unknown kind {name!r}; known kinds: {', '.join(kind_names())}")


def kind_names() -> list[str]:
    _discover()
    own = [n for r in reversed(_visible()) for n in r.kinds]
    return list(dict.fromkeys([*BUILTIN_KINDS, *(n for n in (*_LOADED, *_PATHS, *own) if n not in BUILTIN_KINDS)]))


def kinds() -> list[Kind]:
    """Every kind, loaded: the built-in ones first, then installed and registered ones."""
    return [get_kind(n) for n in dict.fromkeys(kind_names())]


def forget_project_kinds() -> None:
    """Drop the kinds registered in the current registry."""
    _current().kinds.clear()


def _importable_from(rootdir: str | None, lines: list[str]) -> None:
    """Modules beside the ini file import, as pytest's default (prepend) import mode makes them for
    a rootdir conftest: without a conftest, or before one is imported, the rootdir is not on sys.path."""
    if rootdir is not None and rootdir not in sys.path and any(line.split("#", 1)[0].strip() for line in lines):
        sys.path.insert(0, rootdir)


def _ini_lines(lines: list[str], rootdir: str | None):
    """Each line of an ini list that says something, as (raw, without its comment), with the
    modules beside the ini file importable."""
    _importable_from(rootdir, lines)
    for raw in lines:
        line = raw.split("#", 1)[0].strip()
        if line:
            yield raw, line


def parse_ini_kinds(lines: list[str], rootdir: str | None = None) -> list[Kind]:
    """Kinds from ini lines ``package.module:KIND``; a module beside the ini file imports too (read
    before any conftest, so before pytest puts the rootdir on sys.path)."""
    out = []
    for raw, line in _ini_lines(lines, rootdir):
        if ":" not in line or len(line.split()) != 1:
            raise ValueError(f"precision_kinds: cannot read {raw!r}; expected 'package.module:KIND'")
        try:
            kind = resolve(line)
        except Exception as e:  # anything a module raises on import, not only ImportError
            raise ValueError(f"precision_kinds: {line!r}: importing it raised {type(e).__name__}: {e}") from e
        try:
            out.append(register_kind(kind))
        except (TypeError, ValueError) as e:
            raise ValueError(f"precision_kinds: {line!r}: {e}") from e
    return out


# ---- targets ---------------------------------------------------------------------------------

def register(name: str, fn: Callable | None = None, *, kind: str = "softmax", **declared):
    """Register ``fn`` as a target called ``name``; without ``fn``, a decorator. The name follows
    the rule of names (module docstring); ValueError says why it does not. ``declared``: what the
    target supports (``dtypes``, ``forward_only``, ``sdpa``; per kind: ``Kind.declarations``):
    cases outside are skipped with that reason; an unknown or malformed one is a TypeError or
    ValueError naming the target."""
    problem = name_problem(name)
    if problem:
        raise ValueError(f"target name {problem} (it names the target's baseline directory and its -k expression)")
    try:
        k = get_kind(kind)
    except ValueError as e:
        raise ValueError(f"target {name!r}: {e}") from None

    where = _caller()

    def add(f: Callable) -> Callable:
        k.check_target(name, f)
        supports = k.declare(name, declared)
        targets = _current().targets
        visible = _visible_targets()
        old = visible.get(name)
        if old is not None and old.kind != kind:
            raise ValueError(f"target {name!r} is already registered as a {old.kind} target (by {old.origin}); a name "
                             f"is one target: register it for {kind} under another name")
        if old is not None and old.fn is not f:
            raise ValueError(f"target name {name!r} is already registered (by {old.origin}) for another callable")
        clash = next((t for t in visible.values() if t.name != name and file_component(t.name) == file_component(name)),
                     None)
        if clash is not None:
            raise ValueError(f"target names {name!r} and {clash.name!r} would share baseline files (file systems and "
                             "pytest's -k tell names apart without case): give one another name")
        targets[name] = Target(name, f, kind, origin=getattr(f, "__module__", "?") or "?", declared=supports,
                                 where=where)
        return f

    return add(fn) if fn is not None else add


def _caller() -> str:
    """file:line of the code that called ``register`` (the first frame outside this package)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("pytest_precision."):
        frame = frame.f_back
    if frame is None:
        return ""
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def registered(kind: str | None = None) -> list[Target]:
    """Registered targets, in registration order, optionally of one kind."""
    return [t for t in _visible_targets().values() if kind is None or t.kind == kind]


def clear() -> None:
    """Drop the targets registered in the current registry."""
    _current().targets.clear()


INI_ORIGIN = "ini precision_targets"
_INI_SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_.]*")


def parse_ini_targets(lines: list[str], rootdir: str | None = None) -> list[Target]:
    """Targets from ini lines ``package.module:function kind [key=value ...]`` (kind defaults to
    softmax; ``key=value``: what it declares, as ``register``'s keywords, lists comma-separated),
    each named by its ``package.module:function``. Anything importing one raises is a ValueError
    naming its line."""
    out = []
    for raw, line in _ini_lines(lines, rootdir):
        parts = line.split()
        declared = [p for p in parts[1:] if "=" in p]
        parts = [p for p in parts if "=" not in p]
        if len(parts) > 2 or not _INI_SPEC.fullmatch(parts[0]) or len(parts[0]) > 100:
            raise ValueError(f"precision_targets: cannot read {raw!r}; expected 'package.module:function kind "
                             "[key=value ...]'")
        spec, kind_name = parts[0], (parts[1] if len(parts) == 2 else "softmax")
        try:
            kind = get_kind(kind_name)
        except ValueError as e:
            raise ValueError(f"precision_targets: target {spec!r}: {e}") from None
        try:
            obj = resolve(spec)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"precision_targets: cannot import {spec!r}: {e}") from e
        except Exception as e:  # a module that raises on import: the line, not an INTERNALERROR
            raise ValueError(f"precision_targets: {line!r}: importing {spec} raised {type(e).__name__}: {e}") from e
        try:
            kind.check_target(spec, obj)
            supports = kind.declare(spec, dict(_ini_declaration(d) for d in declared))
        except (TypeError, ValueError) as e:
            raise ValueError(f"precision_targets: {e}") from None
        out.append(Target(spec, obj, kind_name, origin=INI_ORIGIN, declared=supports))
    return out


def _ini_declaration(token: str) -> tuple[str, Any]:
    """``key=value`` of an ini target line: ``a,b`` is a list, integers are integers, ``none``
    is None; the kind reads the rest (``true``, ``fp16``)."""
    key, _, value = token.partition("=")
    items = [int(v) if v.strip().lstrip("-").isdigit() else v.strip() for v in value.split(",")]
    one = items[0] if len(items) == 1 else tuple(items)
    return key.strip(), (None if one in ("none", "None") else one)


def target_names_problem(targets: list[Target]) -> str | None:
    """A sentence when a target's name breaks the rule of names (a kind's default targets are not
    registered, so not checked before), or when two of ``targets`` (registered and ini ones
    together) would share baseline files: the same kind and the same name as the file system
    spells it."""
    seen: dict[tuple[str, str], Target] = {}
    for t in targets:
        problem = None if t.origin == INI_ORIGIN else name_problem(t.name)
        if problem:
            return f"{t.kind} target name {problem} ({t.origin})"
        other = seen.setdefault((t.kind, file_component(t.name)), t)
        if other is not t and other.name != t.name:
            a, b = sorted((other.name, t.name))
            return (f"target names {a!r} and {b!r} would share the baseline files of {t.kind}/{sanitize(t.name)}: "
                    "give one another name")
    return None

"""What a target's code is, as a digest.

The fresh regime's default seed is derived from it (``kinds.fresh``), so that an unchanged target
draws the same inputs on every run and machine, and any edit of its code draws new ones. Counted:

- a function by its compiled code (its bytecode, constants and the names it reads, the code nested
  in it included), not its source text: comments, blank lines, a line moved, and the arguments of
  the ``register`` decorator above it (the declarations a run prints, pasted) leave it as it was;
- a callable object (an ``nn.Module``, an instance with ``__call__``) by its class's source;
- one level of what a function names as globals: the functions by their code, the classes by their
  source, the modules by their file (a wrapper in a conftest that calls ``mykernels.attention``
  counts ``mykernels.py``), leaving out installed libraries and the standard library (their
  versions are the machine's, not the code under test).

Nothing of it runs the user's code (attributes are read statically); anything it cannot read counts
by its name. Bytecode is the interpreter's: another Python version draws other inputs.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import sysconfig
import types
from pathlib import Path
from typing import Any, Iterator

__all__ = ["code_digest"]

_LIBRARIES = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                     sysconfig.get_paths()["stdlib"]})
_MISSING = object()


def _static(obj: Any, name: str) -> Any:
    """``obj.name`` without running ``__getattr__`` or properties (user code)."""
    try:
        return inspect.getattr_static(obj, name, _MISSING)
    except Exception:
        return _MISSING


def _unwrap(obj: Any) -> Any:
    """The function or object behind ``obj``: a partial's function, a bound method's, a decorated
    function's wrapped one."""
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif isinstance(obj, types.FunctionType) and _static(obj, "__wrapped__") is not _MISSING:
            obj = obj.__wrapped__
        else:
            break
    return obj


def _library(path: str) -> bool:
    return str(Path(path).resolve()).startswith(_LIBRARIES)


def _code_parts(code: types.CodeType) -> Iterator[bytes]:
    """What a code object computes: bytecode, names, constants (nested code objects recursively)."""
    yield code.co_code
    yield " ".join(code.co_names).encode()
    for const in code.co_consts:
        yield from (_code_parts(const) if isinstance(const, types.CodeType) else (repr(const).encode(),))


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _source_of(obj: Any) -> bytes | None:
    """A class's or module's source text (line endings unified), where it is user code on disk."""
    try:
        path = inspect.getsourcefile(obj)
        if not path or _library(path):
            return None
        text = Path(path).read_bytes() if isinstance(obj, types.ModuleType) else inspect.getsource(obj).encode()
    except (TypeError, OSError):
        return None
    return text.replace(b"\r\n", b"\n")


def _own(obj: Any) -> list[bytes]:
    """What counts of ``obj`` itself (module docstring)."""
    if isinstance(obj, types.FunctionType):
        return [] if _library(obj.__code__.co_filename) else list(_code_parts(obj.__code__))
    if isinstance(obj, (type, types.ModuleType)):
        source = _source_of(obj)
        return [] if source is None else [source]
    source = _source_of(type(obj))  # a callable object: its class
    return [] if source is None else [source]


def code_digest(obj: Any) -> str:
    """A hex digest of ``obj``'s code (module docstring)."""
    target = _unwrap(obj)
    h = hashlib.sha256()
    kind = target if isinstance(target, (types.FunctionType, type, types.ModuleType)) else type(target)
    h.update(f"{getattr(kind, '__module__', '')}:{getattr(kind, '__qualname__', getattr(kind, '__name__', ''))}".encode())
    for part in _own(target):
        h.update(hashlib.sha256(part).digest())
    if isinstance(target, types.FunctionType):
        for name in sorted(set(_names(target.__code__))):
            value = target.__globals__.get(name, _MISSING)
            if value is _MISSING or isinstance(value, (int, float, str, bytes, bool, tuple)):
                continue
            for part in _own(_unwrap(value)) if isinstance(value, (types.FunctionType, type, types.ModuleType,
                                                                   functools.partial)) else ():
                h.update(name.encode() + hashlib.sha256(part).digest())
    return h.hexdigest()

"""What a target's code is, as a digest: the contents of the source files that define it.

The fresh regime's default seed is derived from it (``kinds.fresh``), so that an unchanged
commit draws the same inputs on every run and machine, and any edit of the target's code draws
new ones. Counted: the file that defines the callable (a conftest, a kernel module) and the files
of the functions, classes and modules it names as globals (one level: a wrapper registered in a
conftest that calls ``mykernels.attention`` counts ``mykernels.py``), leaving out installed
libraries and the standard library (their versions are the machine's, not the code under test).
Contents, not paths, with line endings unified: a clone in another directory, or checked out on
Windows, has the same digest.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import sysconfig
import types
from pathlib import Path
from typing import Any, Iterator

__all__ = ["code_digest", "source_files"]

_LIBRARIES = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                     sysconfig.get_paths()["stdlib"]})


def _function(obj: Any) -> Any:
    """The Python function behind ``obj`` (a partial's, a bound method's, a callable instance's
    ``__call__``, a decorated function's wrapped one), or ``obj`` itself."""
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        elif hasattr(obj, "__wrapped__"):
            obj = obj.__wrapped__
        elif not isinstance(obj, (types.FunctionType, type, types.ModuleType)) and callable(obj) \
                and isinstance(getattr(type(obj), "__call__", None), types.FunctionType):
            obj = type(obj).__call__
        else:
            break
    return obj


def _file_of(obj: Any) -> Path | None:
    """The source file defining ``obj`` (a function, class or module), if it has one on disk."""
    try:
        if isinstance(obj, types.FunctionType):
            name = obj.__code__.co_filename
        elif isinstance(obj, (type, types.ModuleType)):
            name = inspect.getsourcefile(obj)
        else:
            return None
    except (TypeError, OSError):
        return None
    if not name:
        return None
    path = Path(name)
    return path if path.is_file() else None


def _names(code: types.CodeType) -> Iterator[str]:
    """The global names ``code`` and the code nested in it (lambdas, inner functions) read."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _library(path: Path) -> bool:
    return str(path.resolve()).startswith(_LIBRARIES)


def source_files(obj: Any) -> list[Path]:
    """The files whose contents make ``obj``'s digest (module docstring), its own first."""
    fn = _function(obj)
    own = _file_of(fn) or _file_of(type(fn))
    files = [own] if own is not None else []
    if isinstance(fn, types.FunctionType):
        for name in dict.fromkeys(_names(fn.__code__)):
            value = fn.__globals__.get(name)
            if value is None or isinstance(value, (int, float, str, bytes, bool, tuple)):
                continue
            path = _file_of(value if isinstance(value, types.ModuleType) else _function(value))
            if path is not None and not _library(path) and path not in files:
                files.append(path)
    return files


def code_digest(obj: Any) -> str:
    """A hex digest of ``obj``'s code: its source files' contents (module docstring) and its name
    there; where it has no source file (a builtin), its module and qualified name."""
    fn = _function(obj)
    h = hashlib.sha256()
    h.update(f"{getattr(fn, '__module__', '')}:{getattr(fn, '__qualname__', type(fn).__qualname__)}".encode())
    for digest in sorted(hashlib.sha256(p.read_bytes().replace(b"\r\n", b"\n")).hexdigest()
                         for p in source_files(obj)):
        h.update(digest.encode())
    return h.hexdigest()

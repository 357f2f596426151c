"""The registry of user callables the suites test ("targets"), and their kinds.

Register from a ``conftest.py`` with ``pytest_precision.register("name", fn, kind="softmax")`` or
``@pytest_precision.register("name", kind="softmax")``, or list them in the ini option
``precision_targets`` as ``package.module:function kind`` lines.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

__all__ = ["Target", "TargetError", "KINDS", "register", "registered", "clear", "parse_ini_targets"]

# kind -> contract, as shown in errors and docs
KINDS: dict[str, str] = {
    "softmax": "fn(x) -> softmax over the last dimension, same shape and dtype as x",
    "log_softmax": "fn(x) -> log_softmax over the last dimension, same shape and dtype as x",
    "attention": "fn(q, k, v, causal[, key_padding_mask=]) -> (B, H, S_q, D) in q's dtype",
    "train_step": "TrainSpec(model_fn, optimizer_fn, batch_fn, steps, step_fn=None) (pytest_precision.training)",
}


@dataclass(frozen=True)
class Target:
    name: str
    fn: Callable
    kind: str
    origin: str = "register()"


class TargetError(Exception):
    """A target raised or broke its kind's contract; the message names target, config and input."""


_REGISTRY: dict[str, Target] = {}


def _check_kind(kind: str, name: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"target {name!r}: unknown kind {kind!r}; known kinds: {', '.join(KINDS)}")


def register(name: str, fn: Callable | None = None, *, kind: str = "softmax"):
    """Register ``fn`` as a target called ``name``; without ``fn``, a decorator."""
    _check_kind(kind, name)

    def add(f: Callable) -> Callable:
        if kind == "train_step":
            from .training import TrainSpec

            if not isinstance(f, TrainSpec):
                raise TypeError(f"target {name!r}: kind train_step takes a pytest_precision.TrainSpec, got {f!r}")
        elif not callable(f):
            raise TypeError(f"target {name!r}: {f!r} is not callable")
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
        spec, kind = parts[0], (parts[1] if len(parts) == 2 else "softmax")
        _check_kind(kind, spec)
        mod_name, _, attr = spec.partition(":")
        try:
            obj = importlib.import_module(mod_name)
            for a in attr.split("."):
                obj = getattr(obj, a)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"precision_targets: cannot import {spec!r}: {e}") from e
        if kind == "train_step":
            from .training import TrainSpec

            if not isinstance(obj, TrainSpec):
                raise ValueError(f"precision_targets: {spec!r} is a {type(obj).__name__}; kind train_step takes a TrainSpec")
        out.append(Target(spec, obj, kind, origin="ini precision_targets"))
    return out

"""The Triton kernels a call launches under Triton's interpreter: their names, the dtypes of
their tensor arguments, what they computed in bfloat16, and which kernel is running now.

The interpreter runs a kernel as Python and numpy, and the torch ops it issues meanwhile
(``aten::set_``, ``aten::empty_like``) are its internals, not the user's code: a trace names them
"inside Triton kernel <name> (interpreted)" with the line that launched it. Where the interpreter's
bfloat16 is wrong, the harness computes it as a GPU does (``interpreter_bf16``), and notes on
the running launch which classes of bf16 ops it computed so and which ops with bf16 operands it
left to the interpreter (``triton.interpreter_excuse`` reads them).
"""
from __future__ import annotations

import contextlib
import sys
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

import torch

__all__ = ["Launch", "watch_launches", "unwatched", "current_kernel", "current_launch", "harness_ops", "as_harness"]


@dataclass(eq=False)
class Launch:
    """One interpreted launch. ``bf16_ops`` and ``unemulated`` fill in while it runs."""

    kernel: str
    dtypes: tuple[str, ...]  # of its tensor arguments, in order
    # classes of bf16 ops ("arithmetic", "comparison", "cast", "dot", "sum") computed as a GPU does
    bf16_ops: set[str] = field(default_factory=set)
    # ops that met bf16 operands and ran as the interpreter has them (not emulated): "tl.atomic_add"
    unemulated: set[str] = field(default_factory=set)


_CURRENT: ContextVar[Launch | None] = ContextVar("pytest_precision_triton_launch", default=None)
_UNWATCHED: ContextVar[bool] = ContextVar("pytest_precision_triton_unwatched", default=False)
# set while the harness itself copies a launch's tensors: the tracer leaves those ops out
_HARNESS: ContextVar[bool] = ContextVar("pytest_precision_harness_ops", default=False)
_WATCHERS: list[list] = []
# callables (kernel name, tensor arguments, their contents before the launch) called after each launch
_OBSERVERS: list = []
_original_run = None


def current_launch() -> Launch | None:
    """The watched interpreted Triton launch running now in this thread, or None."""
    return _CURRENT.get()


def harness_ops() -> bool:
    """Whether the torch ops running now are the harness's own (``as_harness``), not the user's."""
    return _HARNESS.get()


@contextlib.contextmanager
def as_harness() -> Iterator[None]:
    """The torch ops in the block are the harness's own: the tracer leaves them out."""
    token = _HARNESS.set(True)
    try:
        yield
    finally:
        _HARNESS.reset(token)


def _copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    with as_harness():
        return [t.detach().clone() for t in tensors]


def current_kernel() -> str | None:
    """The name of the interpreted Triton kernel running now in this thread, or None."""
    launch = _CURRENT.get()
    return None if launch is None else launch.kernel


def _run(self, *args, grid, warmup, **kwargs):
    if _UNWATCHED.get():
        return _original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    name = getattr(self.fn, "__name__", "?")
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    launch = Launch(name, tuple(str(a.dtype).replace("torch.", "") for a in tensors))
    for launches in _WATCHERS:
        launches.append(launch)
    before = _copies(tensors) if _OBSERVERS else None  # only while a tracer looks: what the kernel wrote
    token = _CURRENT.set(launch)
    try:
        return _original_run(self, *args, grid=grid, warmup=warmup, **kwargs)
    finally:
        _CURRENT.reset(token)
        for observe in list(_OBSERVERS) if before is not None else ():
            observe(name, tensors, before)


@contextlib.contextmanager
def watch_launches(observe=None) -> Iterator[list[Launch]]:
    """Within the block, every interpreted Triton launch is appended to the list yielded (and
    marks its torch ops as its own for the tracer); ``observe(kernel, tensors, before)``, if
    given, is called after each launch with its tensor arguments and copies of their contents
    from before it ran (a tracer's view of what the kernel wrote). Nothing is watched where
    triton's interpreter was never imported: nothing can launch there."""
    global _original_run
    launches: list[Launch] = []
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None:
        yield launches
        return
    cls = interpreter.InterpretedFunction
    if not _WATCHERS:
        _original_run = cls.run
        cls.run = _run
    _WATCHERS.append(launches)
    if observe is not None:
        _OBSERVERS.append(observe)
    try:
        yield launches
    finally:
        _WATCHERS.remove(launches)
        if observe is not None:
            _OBSERVERS.remove(observe)
        if not _WATCHERS:
            cls.run = _original_run


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """Within the block, launches are nobody's: not recorded, no current launch (the harness's
    own kernels, such as the interpreter canary, run inside a target's call without joining it)."""
    hidden, current = _UNWATCHED.set(True), _CURRENT.set(None)
    try:
        yield
    finally:
        _CURRENT.reset(current)
        _UNWATCHED.reset(hidden)

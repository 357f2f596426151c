"""Code that casts to float32 run exactly: float32 read as float64.

An oracle is a target's own code run on float64 inputs. Where that code upcasts on purpose (a loss
that takes ``logits.float()`` and returns a float32 result from 16-bit inputs), the cast would
round the float64 run back to float32, and the result would be no oracle. Inside
``float32_as_float64()`` a cast to float32 (``.float()``, ``.to(torch.float32)``,
``.type(torch.float32)``) is a cast to float64, and a tensor made with ``dtype=torch.float32`` is
made in float64: the code's float32 is its "full precision", which the oracle makes exact. Casts to
16-bit formats are kept: they are what the code computes. Only the code's own calls are read so:
torch's library code keeps its float32 (a ``GradScaler``'s scale and its fused unscale kernel need
float32 tensors).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["float32_as_float64", "read_as_float64"]

_CASTS = {torch.Tensor.float, torch.Tensor.to, torch.Tensor.type}  # Tensor.float first among them


def _is_float32(value) -> bool:
    return value is torch.float32 or value == "torch.FloatTensor"


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OVERRIDES = os.path.join(_TORCH_DIR, "overrides.py")


def _called_by_torch(func) -> bool:
    """Whether the code that called ``func`` is torch's own (past ``torch.overrides``' dispatch, a
    Python-implemented ``func``'s own frame and another mode's ``__torch_function__`` stacked on this
    one: the harness watches a step's first run with one)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == _OVERRIDES or frame.f_code.co_name == "__torch_function__"
                                 or frame.f_code is getattr(func, "__code__", None)):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR)


class float32_as_float64(TorchFunctionMode):
    """A context (module docstring) in which float32 is read as float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        # only a call that names float32 is read anew, and only from the code's own frames (the
        # frame walk is the costly part: most calls name no dtype)
        if not (func in _CASTS or _is_float32(kwargs.get("dtype"))) or _called_by_torch(func):
            return func(*args, **kwargs)
        if func is torch.Tensor.float:
            return args[0].double()
        if func in _CASTS:
            args = (args[0], *(torch.float64 if _is_float32(a) else a for a in args[1:]))
        if _is_float32(kwargs.get("dtype")):
            kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


@contextlib.contextmanager
def read_as_float64():
    """Where code runs in float64 as the truth: its own float32 (``h.float()``, ``dtype=torch.float32``,
    the default dtype) is read as float64 (``float32_as_float64`` and the default dtype float64)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with float32_as_float64():
            yield
    finally:
        torch.set_default_dtype(previous)

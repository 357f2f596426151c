"""Find the first operation that turned finite values into inf or NaN.

A counted overflow at the output often shows up as NaN (exp overflows to inf, then inf / inf):
re-running the failing call under this dispatch mode names the op and the user's source line
where it began. It runs only for failing cases, so the passing path pays nothing.
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["Fault", "first_fault"]

# ops whose inf comes from a zero input (log(0), 1/0): the zero is an underflow upstream
_POLE_OPS = {"log", "log2", "log10", "reciprocal", "div", "rsqrt", "pow", "xlogy"}
_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


@dataclass(frozen=True)
class Fault:
    op: str  # "aten::exp"
    kind: str  # "overflow" | "underflow" | "nan"
    produced: str  # "inf" | "-inf" | "nan"
    where: str  # "file.py:12" of the user's code, or "?"

    def describe(self) -> str:
        return f"first {self.kind} in {self.op} at {self.where}: produced {self.produced} from finite inputs"


def _user_frame() -> str:
    for fr in reversed(traceback.extract_stack()):
        if not fr.filename.startswith(_SKIP_DIRS) and "pluggy" not in fr.filename and "_pytest" not in fr.filename:
            return f"{os.path.basename(fr.filename)}:{fr.lineno}"
    return "?"


class _FirstFaultMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.fault: Fault | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.fault is None:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if outs and all(bool(torch.isfinite(t).all()) for t in ins):
                for t in outs:
                    if bool(torch.isfinite(t).all()):
                        continue
                    name = func._schema.name.split("::")[-1]
                    if bool(torch.isnan(t).any()):
                        kind, produced = "nan", "nan"
                    else:
                        produced = "inf" if bool((t == float("inf")).any()) else "-inf"
                        pole = name in _POLE_OPS and any(bool((i == 0).any()) for i in ins)
                        kind = "underflow" if pole else "overflow"
                    self.fault = Fault(f"aten::{name}", kind, produced, _user_frame())
                    break
        return out


def first_fault(fn, *args, **kwargs) -> Fault | None:
    """Run ``fn(*args, **kwargs)`` and return the first op producing non-finite values from finite
    inputs, or None. Exceptions from ``fn`` propagate."""
    mode = _FirstFaultMode()
    with torch.no_grad(), mode:
        fn(*args, **kwargs)
    return mode.fault

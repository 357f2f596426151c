"""Tensor-core alignment lint: matmuls whose dimensions forfeit the low-precision speed-up.

Tensor cores read operands in 16-byte pieces, so cuBLAS and the fused attention kernels reach
their fast paths only when every matmul dimension is a multiple of 16 bytes' worth of elements:
8 for fp16 and bf16, 16 for fp8, 4 for fp32 under TF32 (NVIDIA's matrix-multiplication
performance guide). A model with a hidden size of 100 runs its fp16 matmuls at a fraction of
the peak and shows a smaller AMP speed-up than the guides quote; this lint says which op and
which dimension. It runs each op under a dispatch mode, so it sees the dtypes autocast chose,
and it warns; it never fails a test.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..platform.user_code import user_frame
from ..numerics.configs import tf32_matmul_allowed

__all__ = ["Misalignment", "TensorCoreAlignmentWarning", "TensorCoreLint", "tensor_core_misalignments",
           "required_multiple", "warn_misalignments"]


class TensorCoreAlignmentWarning(UserWarning):
    """A matmul ran with dimensions that keep it off the tensor cores' fast path."""


_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def required_multiple(dtype: torch.dtype, device_type: str) -> int | None:
    """Elements per 16 bytes for a dtype that runs on tensor cores, None for one that does not
    (fp32 without TF32, fp64, integers)."""
    if dtype in (torch.float16, torch.bfloat16):
        return 8
    if dtype in _FP8:
        return 16
    if dtype == torch.float32 and device_type == "cuda" and tf32_matmul_allowed():
        return 4
    return None


@dataclass(frozen=True)
class Misalignment:
    op: str  # "aten::bmm"
    dtype: str  # "bfloat16"
    dims: tuple[tuple[str, int], ...]  # the offending dimensions: (("K", 59),)
    multiple: int
    where: str  # the user's source line, "file.py:12", or "?"

    def describe(self) -> str:
        dims = ", ".join(f"{n}={v}" for n, v in self.dims)
        return (f"{self.op} in {self.dtype} at {self.where}: {dims} not a multiple of {self.multiple}, "
                "so tensor cores do not give their speed-up")


def _matmul_dims(name: str, args: tuple) -> list[tuple[str, int]] | None:
    """The (name, size) of each dimension that must be aligned, for the ops that run on tensor cores."""
    if name in ("mm", "_scaled_mm", "bmm"):
        a, b = args[0], args[1]
    elif name in ("addmm", "baddbmm"):
        a, b = args[1], args[2]
    elif name.startswith("_scaled_dot_product") and name.endswith(("attention", "attention_for_cpu")):
        q, v = args[0], args[2]
        return [("head dim", q.shape[-1]), ("value head dim", v.shape[-1])]
    else:
        return None
    return [("M", a.shape[-2]), ("K", a.shape[-1]), ("N", b.shape[-1])]


class TensorCoreLint(TorchDispatchMode):
    """Within this mode, ``found`` collects each distinct misaligned matmul (op, dtype, dims)."""

    def __init__(self):
        super().__init__()
        self.found: list[Misalignment] = []
        self._seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        dims = _matmul_dims(name, args)
        if dims is not None and isinstance(args[0], torch.Tensor):
            a = args[0]
            multiple = required_multiple(a.dtype, a.device.type)
            bad = tuple((n, int(v)) for n, v in dims if multiple and v % multiple)
            key = (name, a.dtype, bad)
            if bad and key not in self._seen:
                self._seen.add(key)
                self.found.append(Misalignment(f"aten::{name}", str(a.dtype).replace("torch.", ""), bad, multiple,
                                               user_frame()))
        return func(*args, **(kwargs or {}))


def tensor_core_misalignments(fn, *args, **kwargs) -> list[Misalignment]:
    """Run ``fn(*args, **kwargs)`` once and return the misaligned matmuls it ran."""
    lint = TensorCoreLint()
    with lint:
        fn(*args, **kwargs)
    return lint.found


def warn_misalignments(found: list[Misalignment], where: str) -> None:
    """One warning per misaligned matmul, naming the case or test it came from."""
    for m in found:
        warnings.warn(TensorCoreAlignmentWarning(f"{where}: {m.describe()}"), stacklevel=2)

"""Tiny Triton kernels that show whether this process's Triton interpreter computes bfloat16
right, one per class of defect known in triton 3.9.0, and :func:`measure_defects`, which runs them
and compares each result with torch's (imported only under the interpreter, by ``triton``).

The classes are the ones the bf16 emulation (``interpreter_bf16``) notes on a launch:
arithmetic (``+ - *`` and negation), comparison (``<`` and ``tl.maximum``), cast (fp32 -> bf16
rounding, and subnormals both ways), dot and sum."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launches import unwatched
from .interpreter_bf16 import ARITHMETIC, CAST, COMPARISON, DOT, SUM

__all__ = ["Defect", "measure_defects"]


@dataclass(frozen=True)
class Defect:
    """A bf16 defect the canary saw: the class of ops it concerns, and what it measured."""

    ops: str
    evidence: str

    def __str__(self) -> str:
        return self.evidence


@triton.jit
def arithmetic_bf16(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    tl.store(out_ptr + i, x * y)
    tl.store(out_ptr + N + i, x + y)
    tl.store(out_ptr + 2 * N + i, x - y)
    tl.store(out_ptr + 3 * N + i, -x)


@triton.jit
def compare_bf16(x_ptr, y_ptr, less_ptr, max_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    y = tl.load(y_ptr + i)
    tl.store(less_ptr + i, (x < y).to(tl.int8))
    tl.store(max_ptr + i, tl.maximum(x, y))


@triton.jit
def store_bf16(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.bfloat16))


@triton.jit
def widen_bf16(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.load(x_ptr + i).to(tl.float32))


@triton.jit
def dot_bf16(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tile = i[:, None] * N + i[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


@triton.jit
def sum_bf16(x_ptr, out_ptr, N: tl.constexpr):
    tl.store(out_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, N)), axis=0))


def _g(value: float) -> str:
    return f"{value:.10g}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _first_difference(got: torch.Tensor, right: torch.Tensor) -> int | None:
    differ = (_bits(got) != _bits(right)).nonzero()
    return None if len(differ) == 0 else int(differ[0])


def _arithmetic() -> Defect | None:
    x = torch.tensor([1.5, -2.0, 3.0, 0.1], dtype=torch.bfloat16)
    y = torch.tensor([2.0, 1.0, -3.5, 3.0], dtype=torch.bfloat16)
    out = torch.empty(16, dtype=torch.bfloat16)
    arithmetic_bf16[(1,)](x, y, out, N=4)
    for k, (sign, right) in enumerate((("*", x * y), ("+", x + y), ("-", x - y))):
        i = _first_difference(out[4 * k:4 * k + 4], right)
        if i is not None:
            return Defect(ARITHMETIC, f"its bf16 arithmetic is wrong ({_g(x[i].item())} {sign} {_g(y[i].item())} gives "
                                      f"{_g(out[4 * k + i].item())}, not {_g(right[i].item())})")
    i = _first_difference(out[12:], -x)
    if i is not None:
        return Defect(ARITHMETIC, f"its bf16 negation is wrong (-({_g(x[i].item())}) gives {_g(out[12 + i].item())})")
    return None


def _comparison() -> Defect | None:
    x = torch.tensor([-1.0, 2.0, -3.0, 1.0], dtype=torch.bfloat16)
    y = torch.tensor([-2.0, 1.0, 3.0, -1.0], dtype=torch.bfloat16)
    less = torch.empty(4, dtype=torch.int8)
    top = torch.empty(4, dtype=torch.bfloat16)
    compare_bf16[(1,)](x, y, less, top, N=4)
    right = (x < y).to(torch.int8)
    if not torch.equal(less, right):
        i = int((less != right).nonzero()[0])
        return Defect(COMPARISON, f"its bf16 comparisons are wrong ({_g(x[i].item())} < {_g(y[i].item())} gives "
                                  f"{bool(less[i])})")
    i = _first_difference(top, torch.maximum(x, y))
    if i is not None:
        return Defect(COMPARISON, f"its bf16 max is wrong (max({_g(x[i].item())}, {_g(y[i].item())}) gives "
                                  f"{_g(top[i].item())})")
    return None


def _rounding() -> Defect | None:
    # round to nearest even: 1 + 5 * 2^-10 rounds up, 1 + 3 * 2^-8 is a tie that rounds to even (up)
    x = torch.tensor([1.0048828125, 3.0, -1.0048828125, 1.01171875], dtype=torch.float32)
    y = torch.empty(4, dtype=torch.bfloat16)
    store_bf16[(1,)](x, y, N=4)
    i = _first_difference(y, x.to(torch.bfloat16))
    if i is None:
        return None
    return Defect(CAST, f"its fp32 -> bf16 store rounds wrong ({_g(x[i].item())} stored as {y[i].item():.4g}, "
                        f"correctly rounded {_g(x.to(torch.bfloat16)[i].item())})")


def _subnormals() -> Defect | None:
    x = torch.tensor([1.828e-40, -3.0e-39, 1.0, 0.0], dtype=torch.float32)
    y = torch.empty(4, dtype=torch.bfloat16)
    store_bf16[(1,)](x, y, N=4)
    i = _first_difference(y, x.to(torch.bfloat16))
    if i is not None:
        return Defect(CAST, f"its fp32 -> bf16 cast garbles subnormals ({x[i].item():.4g} gives {y[i].item():.4g}, "
                            f"correctly {x.to(torch.bfloat16)[i].item():.4g})")
    b = torch.tensor([2.0 ** -133, -3 * 2.0 ** -133, 2.0 ** -127, 1.0], dtype=torch.bfloat16)
    w = torch.empty(4, dtype=torch.float32)
    widen_bf16[(1,)](b, w, N=4)
    i = _first_difference(w, b.to(torch.float32))
    if i is not None:
        return Defect(CAST, f"its bf16 -> fp32 cast garbles subnormals ({b[i].item():.4g} gives {w[i].item():.4g})")
    return None


def _dot() -> Defect | None:
    a = torch.ones(16, 16, dtype=torch.bfloat16)
    c = torch.empty(16, 16, dtype=torch.float32)
    dot_bf16[(1,)](a, a, c, N=16)
    if float(c[0, 0]) == 16.0:
        return None
    return Defect(DOT, f"its tl.dot of bf16 operands is wrong (ones(16, 16) @ ones(16, 16) gives {float(c[0, 0]):.4g}, "
                       "not 16)")


def _sum() -> Defect | None:
    x = torch.tensor([1.5, -2.0, 0.25, 3.0], dtype=torch.bfloat16)
    out = torch.empty(1, dtype=torch.bfloat16)
    sum_bf16[(1,)](x, out, N=4)
    if float(out[0]) == 2.75:
        return None
    return Defect(SUM, f"its tl.sum of bf16 is wrong (1.5 - 2 + 0.25 + 3 gives {out[0].item():.4g}, not 2.75)")


def measure_defects() -> tuple[Defect, ...]:
    """Every defect class the canary kernels show in this process's interpreter as it is now
    (with or without the emulation), each as its evidence. The kernels' launches join no target's."""
    found = []
    with unwatched():
        for ops, check in ((ARITHMETIC, _arithmetic), (COMPARISON, _comparison), (CAST, _rounding), (CAST, _subnormals),
                           (DOT, _dot), (SUM, _sum)):
            try:
                found.append(check())
            except Exception as e:  # an interpreter that cannot run the kernel cannot compute it right either
                found.append(Defect(ops, f"its {ops} canary kernel {check.__name__.strip('_')} raised "
                                         f"{type(e).__name__}: {e}"))
    return tuple(d for d in found if d is not None)

"""Fused softmax / log-softmax over the last dimension, in Triton, with the log-sum-exp.

One program per row. Any input dtype of fp16, bf16 and fp32 is read, arithmetic is fp32 inside,
the output has the input's dtype and the log-sum-exp is fp32. A row that fits in one block is
loaded once; a longer row is reduced online (running max, running sum rescaled by
exp(old max - new max) whenever the max grows) and then normalised in a second pass.

The sum is kept as ``s = sum(exp(x - max)) - 1``, the terms other than one copy of the max
(whose term is exactly 1), and log-sum-exp = max + log1p(s). Where one logit dominates its row,
log-softmax there is ``-log1p(s)``, near 0: computing it as ``log(1 + s)`` in fp32 leaves the
rounding of ``1 + s`` in it, tens of ULPs of a small result; log1p keeps a few.

A fully masked row (every logit -inf) gives NaN in every position, as torch does and as the
softmax suite requires (the exact value is 0/0): the max is -inf, so ``x - max`` is NaN there.
Its log-sum-exp is -inf.

Forward and backward go through ``torch.autograd.Function``; the backward is a second row
kernel (softmax: dx = y (dy - sum(dy y)); log-softmax: dx = dy - exp(y) sum(dy)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pytest_precision.kernels.accurate import _exp, accurate_math, exp  # noqa: F401 (_exp: called in kernels)
from pytest_precision.kernels.runtime import LazyKernel, boundary_dtype, interpreting
from pytest_precision.platform.triton import needs_triton

__all__ = ["softmax", "log_softmax", "softmax_with_lse", "MAX_BLOCK"]

# Longest row held in registers at once; longer rows take the online path. 8192 fp32 values per
# program is 16 per thread at 16 warps on a GPU.
MAX_BLOCK = 8192
SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)


def _softmax_forward_kernel(x_ptr, y_ptr, lse_ptr, n_cols, x_stride, y_stride,
                            LOG: tl.constexpr, BLOCK: tl.constexpr, SINGLE: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    y_row = y_ptr + row * y_stride
    cols = tl.arange(0, BLOCK)
    if SINGLE:  # the whole row in one block: read it once
        inside = cols < n_cols
        x = tl.load(x_row + cols, mask=inside, other=-float("inf")).to(tl.float32)
        m, at = tl.max(x, 0, return_indices=True)
        m_safe = tl.where(m == -float("inf"), 0.0, m)  # a fully masked row keeps s 0, not NaN
        s = tl.sum(tl.where(cols == at, 0.0, _exp(x - m_safe, ACCURATE)), 0)
        log_l = _log1p(s)
        if LOG:
            y = (x - m) - log_l
        else:
            y = tl.div_rn(_exp(x - m, ACCURATE), 1.0 + s)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        # pass 1, online: running max m and s = sum of exp(x - m) over the blocks seen so far,
        # less the max's own term 1
        m = tl.full([], -float("inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
            b_max, at = tl.max(x, 0, return_indices=True)
            grows = b_max > m
            m_new = tl.maximum(m, b_max)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            e = _exp(x - m_safe, ACCURATE)
            if grows:  # the max moved into this block: rescale the old sum, the old max's 1 included
                alpha = _exp(m - m_safe, ACCURATE)
                s = (s + 1.0) * alpha + tl.sum(tl.where(cols == at, 0.0, e), 0)
            else:
                s = s + tl.sum(e, 0)
            m = m_new
        log_l = _log1p(s)
        # pass 2: normalise
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            inside = offs < n_cols
            x = tl.load(x_row + offs, mask=inside, other=-float("inf")).to(tl.float32)
            if LOG:
                y = (x - m) - log_l
            else:
                y = tl.div_rn(_exp(x - m, ACCURATE), 1.0 + s)
            tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
    tl.store(lse_ptr + row, m + log_l)


def _log1p(s):
    # log(1 + s) to a few ULPs for small s, with core ops only (Goldberg): the rounding of u = 1 + s
    # cancels in log(u) * s / (u - 1). s >= 0 here.
    u = 1.0 + s
    return tl.where(u == 1.0, s, tl.log(u) * tl.div_rn(s, u - 1.0))


def _softmax_backward_kernel(y_ptr, dy_ptr, dx_ptr, n_cols, y_stride, dy_stride, dx_stride,
                             LOG: tl.constexpr, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    # pass 1: softmax needs sum(dy * y), log-softmax sum(dy)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        inside = offs < n_cols
        dy = tl.load(dy_ptr + row * dy_stride + offs, mask=inside, other=0.0).to(tl.float32)
        if LOG:
            acc += dy
        else:
            y = tl.load(y_ptr + row * y_stride + offs, mask=inside, other=0.0).to(tl.float32)
            acc += dy * y
    s = tl.sum(acc, 0)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        inside = offs < n_cols
        dy = tl.load(dy_ptr + row * dy_stride + offs, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * y_stride + offs, mask=inside, other=0.0).to(tl.float32)
        if LOG:
            dx = dy - _exp(y, ACCURATE) * s
        else:
            dx = y * (dy - s)
        tl.store(dx_ptr + row * dx_stride + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside)


log1p = LazyKernel(_log1p)
softmax_forward_kernel = LazyKernel(_softmax_forward_kernel, helpers=[log1p, exp])
softmax_backward_kernel = LazyKernel(_softmax_backward_kernel, helpers=[exp])


def _block_for(n_cols: int, block: int | None) -> int:
    if block is not None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        return block
    return min(triton.next_power_of_2(max(n_cols, 16)), MAX_BLOCK)


def _num_warps(block: int) -> int:
    return 4 if block <= 2048 else (8 if block <= 4096 else 16)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in SUPPORTED:
        raise TypeError(f"triton softmax: input dtype {x.dtype} not supported (fp16, bf16, fp32)")
    if x.device.type == "cpu" and not interpreting():
        raise RuntimeError("triton softmax: CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    return x.reshape(-1, x.shape[-1]).contiguous() if x.dim() else x.reshape(1, 1)


def softmax_forward(x: torch.Tensor, *, log: bool = False, block: int | None = None):
    """(softmax or log-softmax of ``x`` over its last dimension in x's dtype, fp32 log-sum-exp
    shaped ``x.shape[:-1]``), no autograd. ``block`` forces the block size (a power of two);
    rows longer than it take the online path."""
    x2 = _rows(x)
    x2 = x2.to(boundary_dtype(x2.dtype))  # bf16 crosses as fp32 under the interpreter (runtime.py)
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    lse = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows and n_cols:
        b = _block_for(n_cols, block)
        softmax_forward_kernel[(n_rows,)](x2, y, lse, n_cols, x2.stride(0), y.stride(0),
                                          LOG=log, BLOCK=b, SINGLE=n_cols <= b, ACCURATE=accurate_math(),
                                          num_warps=_num_warps(b))
    return y.to(x.dtype).reshape(x.shape), lse.reshape(x.shape[:-1])


def softmax_backward(y: torch.Tensor, dy: torch.Tensor, *, log: bool = False, block: int | None = None):
    y2 = _rows(y)
    y2 = y2.to(boundary_dtype(y2.dtype))
    dy2 = dy.to(y2.dtype).reshape(y2.shape).contiguous()
    dx = torch.empty_like(y2)
    n_rows, n_cols = y2.shape
    if n_rows and n_cols:
        b = _block_for(n_cols, block)
        softmax_backward_kernel[(n_rows,)](y2, dy2, dx, n_cols, y2.stride(0), dy2.stride(0), dx.stride(0),
                                           LOG=log, BLOCK=b, ACCURATE=accurate_math(), num_warps=_num_warps(b))
    return dx.to(y.dtype).reshape(y.shape)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, block):
        y, lse = softmax_forward(x, log=log, block=block)
        ctx.save_for_backward(y)
        ctx.log, ctx.block = log, block
        ctx.mark_non_differentiable(lse)
        return y, lse

    @staticmethod
    def backward(ctx, dy, _dlse):
        (y,) = ctx.saved_tensors
        return softmax_backward(y, dy, log=ctx.log, block=ctx.block), None, None


def softmax_with_lse(x: torch.Tensor, *, log: bool = False, block: int | None = None):
    """(softmax or log-softmax over the last dimension, log-sum-exp), differentiable in x."""
    return _Softmax.apply(x, log, block)


@needs_triton
def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension (the ``triton.softmax`` built-in target)."""
    return softmax_with_lse(x)[0]


@needs_triton
def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax over the last dimension (the ``triton.log_softmax`` built-in target)."""
    return softmax_with_lse(x, log=True)[0]

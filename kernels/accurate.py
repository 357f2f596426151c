"""exp in Triton kernels as accurate on a GPU as under the interpreter.

The interpreter computes ``tl.exp`` and ``/`` with numpy, to within an ULP. Compiled for NVIDIA
GPUs (triton 3.9), ``tl.exp(x)`` is ``ex2.approx.f32`` of ``x * log2(e)``, where the rounding of
that product alone makes a relative error of about |x| 2^-24 (100 ULPs of fp32 at x = -100: the
softmax of logits at scale 20 and more), and ``/`` is ``div.full.f32`` (2 ULPs). A kernel judged
against torch's own ops (libdevice's ``expf``, IEEE division) would fail its budgets for that
alone. (``tl.log`` compiles to the same FMA-based code as libdevice's ``logf``: nothing to do.)

``exp`` here takes a constexpr ``ACCURATE``: on, it is libdevice's ``__nv_expf`` (2 ULPs over the
whole range; ``runtime.COMPILE_OPTIONS`` keeps its subnormal results from being flushed); off,
``tl.exp``. It is off under the interpreter (libdevice does not exist there, and numpy is
accurate) and where a kernel rounds the result to 16 bits anyway (flash attention's fp16 and bf16
probabilities: an error of 2^-24 |x| is far below their 8 or 11 bits). Division a budget needs
exact is ``tl.div_rn``: correctly rounded on the GPU, numpy's division under the interpreter.

Cost, counted in the compiled code (SASS, sm_80 and sm_90; not timed: no GPU has run it): an exp is 9
instructions instead of 4; a division 118 static instructions instead of 8, most of them
``div.rn``'s path for extreme operands. The softmax kernels are memory-bound and divide once per
element; flash attention divides once per output element, after its dots.
"""
from __future__ import annotations

import triton.language as tl
from triton.language.extra import libdevice

from pytest_precision.kernels.runtime import LazyKernel, interpreting

__all__ = ["exp", "accurate_math"]


def accurate_math() -> bool:
    """ACCURATE for kernels whose every exp must be accurate: on unless interpreting."""
    return not interpreting()


def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


exp = LazyKernel(_exp)

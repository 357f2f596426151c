"""How the project's Triton kernels are launched, and the interpreter traps they avoid.

Where Triton code can run at all (CUDA, or the interpreter with ``TRITON_INTERPRET=1`` set before
triton is imported) is ``pytest_precision.kinds.triton``. Our kernels are jitted on their first
launch, in the mode of the process's triton.

The interpreter's ``tl.dot`` on bfloat16 operands multiplies the raw bit patterns (triton 3.9.0,
upstream triton-lang/triton#11584, "not supported yet"): results around 1e10 for unit inputs.
fp16, fp32 and fp8 dots are right, and so is a dot of operands cast to fp32 first. Kernels with
dots take a constexpr ``UPCAST_DOT`` that casts the operands to fp32 before the dot; it is on
only under the interpreter (``upcast_dot()``). This does not change the numerics being judged:
the product of two bf16 (or fp16) numbers is exact in fp32, and the GPU's bf16 dots accumulate
in fp32 too, so only the order of the fp32 additions can differ.

The interpreter's bfloat16 casts are wrong as well (measured, triton 3.9.0): fp32 -> bf16
truncates instead of rounding to nearest even, and fp32 subnormals come out as unrelated values
(1.8e-40 becomes 1.2e-38); a load of bf16 widened to fp64 reads the raw bits. So under the
interpreter bf16 tensors cross the kernel boundary as fp32 (``boundary_dtype``: widening is exact,
and torch rounds the fp32 results to bf16 correctly), and the kernels' own bf16 roundings (flash
attention's p and ds before their dots) are done on the bits, round to nearest even, as the GPU
does. A bf16 kernel is therefore never judged on the interpreter's bf16 bugs.
"""
from __future__ import annotations

import contextlib
import os
import types

from pytest_precision.kinds.triton import (INTERPRET_HINT, interpret_requested, interpreting, triton_installed,
                                           unavailable)

__all__ = ["triton_installed", "interpret_requested", "interpreting", "upcast_dot", "boundary_dtype", "unavailable",
           "builtin_enabled", "LazyKernel", "INTERPRET_HINT"]


@contextlib.contextmanager
def _mode_env(interpret: bool):
    """TRITON_INTERPRET as triton was imported with, around jitting and launching our kernels
    (triton reads it there too), restored afterwards."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def upcast_dot() -> bool:
    """Cast dot operands to fp32 first: only under the interpreter (bf16 dot trap, module doc)."""
    return interpreting()


def boundary_dtype(dtype):
    """The dtype a kernel reads and writes for a tensor of ``dtype``: fp32 for bf16 and the fp8
    formats under the interpreter (module doc), ``dtype`` otherwise."""
    import torch

    narrow = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    return torch.float32 if interpreting() and dtype in narrow else dtype


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def builtin_enabled() -> bool:
    """Whether the suites list the kernels among their built-in targets: on a CUDA machine, or
    when the interpreter is on. Off otherwise, because the interpreter is slow and opt-in; the
    main job on a CPU machine turns it on (README, .ci/run)."""
    return interpret_requested() or (triton_installed() and _cuda())


class LazyKernel:
    """A Triton kernel (a plain function in Triton's language) jitted on its first launch, once
    per mode: ``kernel[grid](*args)`` as with ``triton.jit``. ``helpers``: LazyKernels of the
    device functions it calls, jitted in the same mode and bound to their names for it."""

    def __init__(self, fn, helpers=()):
        self.fn = fn
        self.helpers = tuple(helpers)
        self._jitted = {}
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def jitted(self):
        import triton

        mode = interpreting()
        if mode not in self._jitted:
            fn = self.fn
            if self.helpers:  # a copy of the function whose globals name this mode's helpers
                names = dict(fn.__globals__)
                names.update({h.__name__: h.jitted() for h in self.helpers})
                fn = types.FunctionType(fn.__code__, names, fn.__name__, fn.__defaults__, fn.__closure__)
                fn.__module__, fn.__qualname__, fn.__doc__ = self.fn.__module__, self.fn.__qualname__, self.fn.__doc__
            with _mode_env(mode):
                self._jitted[mode] = triton.jit(fn)
        return self._jitted[mode]

    def __getitem__(self, grid):
        launch = self.jitted()[grid]
        if not interpreting():
            return launch

        def interpreted(*args, **kwargs):
            # the interpreter runs on numpy, which warns on inf - inf and log(0): those are the
            # intended IEEE results here (masked rows), not mistakes
            import numpy as np
            with _mode_env(True), np.errstate(all="ignore"):
                return launch(*args, **kwargs)
        return interpreted

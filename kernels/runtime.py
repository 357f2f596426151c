"""How the project's Triton kernels are launched, and the interpreter traps they avoid.

Where Triton code can run at all (CUDA, or the interpreter with ``TRITON_INTERPRET=1`` set before
triton is imported) is ``pytest_precision.platform.triton``. Our kernels are jitted on their first
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
import contextvars
import types
from dataclasses import dataclass, field

from pytest_precision.platform.triton import (INTERPRET_HINT, interpret_env, interpret_requested, interpreting, triton_installed,
                                           unavailable)

__all__ = ["triton_installed", "interpret_requested", "interpreting", "upcast_dot", "boundary_dtype", "unavailable",
           "builtin_enabled", "LazyKernel", "INTERPRET_HINT", "Launch", "compile_only", "COMPILE_OPTIONS"]




# Compile options of every kernel launch on a GPU, pinned rather than left to triton's defaults:
# - enable_fp_fusion off: a * b + c stays two roundings, as under the interpreter, instead of an
#   FMA wherever the compiler finds one (triton 3.9 fuses by default and 3.10 will not: a triton
#   upgrade must not move the numerics);
# - enable_reflect_ftz off: libdevice functions keep subnormal results instead of flushing them
#   to 0 (kernels/accurate.py), as torch's own ops do.
COMPILE_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


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


@dataclass
class Launch:
    """One launch seen under ``compile_only()``: the kernel, the grid the wrapper asked for, the
    options it passed (constexprs, ``num_warps``, ``num_stages``) and what Triton compiled."""

    kernel: str
    grid: tuple
    options: dict = field(default_factory=dict)
    compiled: object = None  # triton's CompiledKernel: .metadata.shared, .asm["ptx"], ...


_COMPILE_ONLY: contextvars.ContextVar[list | None] = contextvars.ContextVar("compile_only", default=None)


@contextlib.contextmanager
def compile_only():
    """Within it, a kernel launch compiles the kernel for triton's current target, with the real
    arguments and options of the wrapper that launched it, and records a ``Launch`` in the list it
    yields, instead of running anything. Tensors on torch's ``meta`` device are enough: nothing
    is read. This is how the kernels are compiled for GPUs on a machine without one
    (``pytest_precision.kernels.compile_check``); the interpreter compiles nothing, so it refuses."""
    if interpreting():
        raise RuntimeError("compile_only: triton runs in interpreter mode in this process, which compiles nothing; "
                           "use a process where triton was imported without TRITON_INTERPRET")
    launches: list[Launch] = []
    token = _COMPILE_ONLY.set(launches)
    try:
        yield launches
    finally:
        _COMPILE_ONLY.reset(token)


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
                # the compiler reads tl.constexpr parameters from the annotations; the interpreter
                # does not need them, so losing them here passes every CPU test
                fn.__annotations__ = dict(self.fn.__annotations__)
                fn.__kwdefaults__ = self.fn.__kwdefaults__
            with interpret_env(mode):
                self._jitted[mode] = triton.jit(fn)
        return self._jitted[mode]

    def __getitem__(self, grid):
        launches = _COMPILE_ONLY.get()
        if launches is not None:
            jitted = self.jitted()

            def compile_launch(*args, **kwargs):
                compiled = jitted.run(*args, grid=grid, warmup=True, **COMPILE_OPTIONS, **kwargs)
                launches.append(Launch(self.__name__, tuple(grid), dict(kwargs), compiled))
            return compile_launch
        launch = self.jitted()[grid]
        if not interpreting():
            return lambda *args, **kwargs: launch(*args, **COMPILE_OPTIONS, **kwargs)

        def interpreted(*args, **kwargs):
            # the interpreter runs on numpy, which warns on inf - inf and log(0): those are the
            # intended IEEE results here (masked rows), not mistakes
            import numpy as np
            with interpret_env(True), np.errstate(all="ignore"):
                return launch(*args, **kwargs)
        return interpreted

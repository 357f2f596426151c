"""Where Triton code can run, and the one skip rule for targets that need it.

Natively Triton kernels need CUDA. On the CPU they run under Triton's interpreter, which triton
turns on with the environment variable ``TRITON_INTERPRET=1``. Triton reads it when a function is
jitted, and its own library functions (``tl.max`` and friends) are jitted when triton is imported,
so the variable must be set before triton is imported: the process's triton is then in
interpreter mode for good (``interpreting()`` asks triton itself).

A target callable marked with :func:`needs_triton` (the project's kernels are) is skipped, with
the reason, where Triton cannot run, instead of failing; under the interpreter it is not timed
(its time is the interpreter's, seconds per call).

bfloat16 under the interpreter: a canary (``triton_canary``) measures once per process whether the
interpreter computes bf16 wrong (``interpreter_defects``); where it does, every call of a target
runs inside ``bf16_as_on_gpu``, which computes bf16 as a GPU does (``interpreter_bf16``), and the
canary, run again under it, lists what is still wrong (``residual_interpreter_defects``: none in
triton 3.9.0). A failing case is excused (``interpreter_excuse``) only where its launches met one
of those, or an op with bf16 operands that the emulation does not cover.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
from unittest import mock

from .devices import interpret_requested

__all__ = ["INTERPRET_HINT", "triton_error", "interpret_env", "needs_triton", "uses_triton", "triton_installed", "interpret_requested",
           "interpreting", "unavailable", "skip_reason", "interpreted", "interpreter_defects",
           "residual_interpreter_defects", "bf16_as_on_gpu", "interpreter_excuse"]

INTERPRET_HINT = "set TRITON_INTERPRET=1 before starting pytest to run them on the CPU under Triton's interpreter"


def triton_error(error: BaseException) -> str | None:
    """What to do, when ``error`` is Triton finding no device to launch a kernel on (a Triton
    kernel called on a CPU machine without the interpreter: "0 active drivers"), else None."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    in_triton = tb is not None and "triton" in tb.tb_frame.f_code.co_filename.replace("\\", "/").split("/")
    if not (isinstance(error, RuntimeError) and "active drivers" in str(error) and in_triton):
        return None
    return (f"a Triton kernel cannot launch here: there is no GPU and Triton's interpreter is off; {INTERPRET_HINT} "
            "(or mark the target with pytest_precision.needs_triton to have its cases skipped where Triton cannot run)")


def needs_triton(fn):
    """Mark ``fn`` as running Triton kernels (the suites skip it where they cannot run)."""
    fn.needs_triton = True
    return fn


def uses_triton(fn) -> bool:
    return bool(getattr(fn, "needs_triton", False))


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter in this process: triton was imported in
    interpreter mode, or is not imported yet and TRITON_INTERPRET is set."""
    if "triton.language.standard" in sys.modules:
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(standard.max, InterpretedFunction)
    return interpret_requested()


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def unavailable(device: str) -> str | None:
    """Why Triton kernels cannot run on ``device`` ("cpu" or "cuda") here, or None."""
    if not triton_installed():
        return "Triton kernels: triton is not installed (pip install triton; Linux only)"
    if device == "cpu" and not interpreting():
        return f"Triton kernels need CUDA or the interpreter: {INTERPRET_HINT}"
    if device.startswith("cuda") and not interpreting() and not _cuda():
        return "Triton kernels: no CUDA device"
    return None


def skip_reason(fn, device: str) -> str | None:
    """Why a case of target callable ``fn`` must be skipped on ``device``, or None."""
    return unavailable(device) if uses_triton(fn) else None


def interpreted(fn, device: str) -> bool:
    """Whether ``fn`` runs Triton kernels under the interpreter here (on the CPU): its time is the
    interpreter's, nothing the speed gate should record."""
    return uses_triton(fn) and not device.startswith("cuda")


def interpret_env(interpret: bool):
    """TRITON_INTERPRET set around jitting and launching a kernel (triton reads it there too, not
    only at import), restored afterwards."""
    return mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1" if interpret else "0"})


@functools.lru_cache(maxsize=1)
def interpreter_defects() -> tuple:
    """The bfloat16 defects of this process's Triton interpreter as it is (``triton_canary.Defect``
    s: the class of ops, and the evidence), empty when the canary kernels compute right or no
    interpreter runs here. Measured once per process: triton 3.9.0's interpreter computes bf16
    arithmetic, comparisons, sums and dots on the raw bit patterns and truncates fp32 -> bf16 casts
    (garbling subnormals)."""
    if not (triton_installed() and interpreting()):
        return ()
    from .interpreter_bf16 import emulating

    if emulating():
        raise RuntimeError("the raw interpreter canary cannot run inside the bf16 emulation")
    return _canary()


@functools.lru_cache(maxsize=1)
def residual_interpreter_defects() -> tuple:
    """The defects the canary still sees with the bf16 emulation on (expected: none); empty where
    the interpreter had none to emulate."""
    if not interpreter_defects():
        return ()
    from .interpreter_bf16 import emulate_bf16

    with emulate_bf16():
        return _canary()


def _canary() -> tuple:
    import numpy as np

    with interpret_env(True), np.errstate(all="ignore"):
        from .triton_canary import measure_defects

        return measure_defects()


def bf16_as_on_gpu():
    """A context within which interpreted Triton code computes bfloat16 as a GPU does
    (``interpreter_bf16.emulate_bf16``), where this process's interpreter gets bf16 wrong; a no-op
    where triton is neither imported nor requested in interpreter mode, runs compiled, or its
    interpreter computes bf16 right (a triton that fixes its interpreter runs untouched)."""
    if "triton.language.standard" not in sys.modules and interpret_requested() and triton_installed():
        # the target may import its kernels only when called (a model_fn importing its module): the
        # interpreter it will get is imported now, so the emulation covers its first call too
        import triton.language  # noqa: F401
    if "triton.language.standard" not in sys.modules or not interpreting() or not interpreter_defects():
        return contextlib.nullcontext()
    from .interpreter_bf16 import emulate_bf16

    return emulate_bf16()


def interpreter_excuse(launches, error: BaseException | None = None) -> str | None:
    """Why a failing case (or, with ``error``, one whose call raised it) is the interpreter's fault
    rather than the target's: a launch it made ran an op with bfloat16 operands that the bf16
    emulation does not cover, or computed a class of bf16 ops in which the canary still sees a
    defect under the emulation. The reason names each op or defect and its kernel. None otherwise:
    the case is judged like any other."""
    if not interpreter_defects():
        return None
    residual = residual_interpreter_defects()
    reasons: list[str] = []
    for launch in launches:
        reasons += [f"kernel {launch.kernel} ran {op} on bfloat16 operands, which the interpreter does not run "
                    "as a GPU does and the harness does not emulate" for op in sorted(launch.unemulated)]
        reasons += [f"kernel {launch.kernel} computed bf16 {d.ops}, and even under the harness's bf16 emulation "
                    f"{d.evidence}" for d in residual if d.ops in launch.bf16_ops]
    if not reasons:
        return None
    import triton

    raised = "" if error is None else f"; the call raised {type(error).__name__}: {error}"
    return (f"Triton's interpreter (triton {triton.__version__}) cannot judge this bfloat16 case: "
            f"{'; '.join(dict.fromkeys(reasons))}{raised}. Run the case on a GPU (or compute that part in fp32 "
            "under the interpreter).")

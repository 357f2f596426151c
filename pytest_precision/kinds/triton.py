"""Where Triton code can run, and the one skip rule for targets that need it.

Natively Triton kernels need CUDA. On the CPU they run under Triton's interpreter, which triton
turns on with the environment variable ``TRITON_INTERPRET=1``. Triton reads it when a function is
jitted, and its own library functions (``tl.max`` and friends) are jitted when triton is imported,
so the variable must be set before triton is imported: the process's triton is then in
interpreter mode for good (``interpreting()`` asks triton itself).

A target callable marked with :func:`needs_triton` (the project's kernels are) is skipped, with
the reason, where Triton cannot run, instead of failing; under the interpreter it is not timed
(its time is the interpreter's, seconds per call).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
from unittest import mock

from ..numerics.devices import interpret_requested

__all__ = ["INTERPRET_HINT", "triton_error", "first_launch_failure", "forget_launch_failures", "interpret_env", "needs_triton", "uses_triton", "triton_installed", "interpret_requested",
           "interpreting", "unavailable", "skip_reason", "interpreted", "interpreter_defects", "interpreter_excuse"]

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


_LAUNCH_FAILURES: dict[str, str] = {}  # target name -> the case that reported it cannot launch Triton here


def first_launch_failure(target: str, case: str) -> str | None:
    """The case that already failed because ``target``'s Triton kernel cannot launch here (its
    later cases are skipped, pointing there), or None after noting ``case`` as that case."""
    first = _LAUNCH_FAILURES.setdefault(target, case)
    return None if first == case else first


def forget_launch_failures() -> None:
    """A new session reports a failing launch again (pytester runs several in one process)."""
    _LAUNCH_FAILURES.clear()


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
def interpreter_defects() -> tuple[str, ...]:
    """The bfloat16 defects of this process's Triton interpreter, each as its evidence (empty when
    the canary kernels compute right, or no interpreter runs here). Measured once per process:
    triton 3.9.0's interpreter stores fp32 -> bf16 by truncation and garbles fp32 subnormals, and
    its ``tl.dot`` on bf16 operands multiplies the raw bit patterns."""
    if not (triton_installed() and interpreting()):
        return ()
    import numpy as np
    import torch

    found = []
    with interpret_env(True), np.errstate(all="ignore"):
        from . import triton_canary

        x = torch.tensor([1.0048828125, 1.828e-40, 3.0, -1.0048828125], dtype=torch.float32)
        y = torch.empty(4, dtype=torch.bfloat16)
        triton_canary.store_bf16[(1,)](x, y, N=4)
        right = x.to(torch.bfloat16)
        if not torch.equal(y.view(torch.int16), right.view(torch.int16)):
            i = int((y.view(torch.int16) != right.view(torch.int16)).nonzero()[0])
            found.append(f"its fp32 -> bf16 store rounds wrong ({x[i].item():.10g} stored as {y[i].item():.4g}, "
                         f"correctly rounded {right[i].item():.10g})")
        a = torch.ones(16, 16, dtype=torch.bfloat16)
        c = torch.empty(16, 16, dtype=torch.float32)
        triton_canary.dot_bf16[(1,)](a, a, c, N=16)
        if float(c[0, 0]) != 16.0:
            found.append(f"its tl.dot of bf16 operands is wrong (ones(16, 16) @ ones(16, 16) gives {float(c[0, 0]):.4g}, "
                         "not 16)")
    return tuple(found)


def interpreter_excuse(launches) -> str | None:
    """Why a failing case is the interpreter's fault rather than the target's: it launched
    interpreted Triton kernels with bfloat16 tensors, and this interpreter's bfloat16 is wrong.
    None when that is not so."""
    kernels = sorted({launch.kernel for launch in launches if launch.bf16})
    if not kernels:
        return None
    defects = interpreter_defects()
    if not defects:
        return None
    import triton

    return (f"Triton's interpreter (triton {triton.__version__}) cannot judge bfloat16 kernels: "
            f"{'; '.join(defects)}; the failing call ran {', '.join(kernels)} on bfloat16 tensors there. "
            "Run the case on a GPU (or convert bf16 to fp32 at the kernel boundary under the interpreter).")

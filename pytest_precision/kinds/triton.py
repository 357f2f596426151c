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

import importlib.util
import os
import sys

__all__ = ["INTERPRET_HINT", "needs_triton", "uses_triton", "triton_installed", "interpret_requested",
           "interpreting", "unavailable", "skip_reason", "interpreted"]

INTERPRET_HINT = "set TRITON_INTERPRET=1 before starting pytest to run them on the CPU under Triton's interpreter"


def needs_triton(fn):
    """Mark ``fn`` as running Triton kernels (the suites skip it where they cannot run)."""
    fn.needs_triton = True
    return fn


def uses_triton(fn) -> bool:
    return bool(getattr(fn, "needs_triton", False))


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_requested() -> bool:
    """Whether TRITON_INTERPRET is set in the environment."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


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

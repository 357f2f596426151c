"""The kernels as built-in targets of the suites.

The suites list ``triton.softmax``, ``triton.log_softmax`` and ``triton.flash_attention`` beside
torch's ops when ``runtime.builtin_enabled()`` (a CUDA machine, or TRITON_INTERPRET=1). They are
marked with ``needs_triton``, so where the kernels cannot run (no triton, or CPU tensors without
the interpreter) their cases are skipped with the reason (``pytest_precision.platform.triton``).

On a CPU their cases take about 80 s of the main job (2 cores; small shapes).
"""
from __future__ import annotations

import importlib

from pytest_precision.kernels.runtime import builtin_enabled, triton_installed
from pytest_precision.kinds.registry import Target
from pytest_precision.platform.triton import interpreted, needs_triton, skip_reason

__all__ = ["needs_triton", "skip_reason", "interpreted", "builtin_targets", "BUILTIN"]

# target name -> (module in pytest_precision.kernels, function, kind)
BUILTIN = {
    "triton.softmax": ("softmax", "softmax", "softmax"),
    "triton.log_softmax": ("softmax", "log_softmax", "log_softmax"),
    "triton.flash_attention": ("flash_attention", "flash_attention", "attention"),
}


def _missing(name: str):
    # triton absent but the interpreter asked for: a marked stand-in, so the cases skip with the reason
    @needs_triton
    def missing(*args, **kwargs):
        raise RuntimeError(f"{name}: triton is not installed")
    return missing


def builtin_targets(kinds) -> list[Target]:
    """The kernel targets of ``kinds``, or none when the kernels are not enabled here."""
    if not builtin_enabled():
        return []
    out = []
    for name, (module, attr, kind) in BUILTIN.items():
        if kind not in kinds:
            continue
        if triton_installed():
            fn = getattr(importlib.import_module(f"pytest_precision.kernels.{module}"), attr)
        else:
            fn = _missing(name)
        out.append(Target(name, fn, kind, origin="built-in (Triton kernel)"))
    return out

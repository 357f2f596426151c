"""The kernels as built-in targets of the suites, and when they are skipped.

The suites list ``triton.softmax``, ``triton.log_softmax`` and ``triton.flash_attention`` beside
torch's ops when ``runtime.builtin_enabled()`` (a CUDA machine, or TRITON_INTERPRET=1). A callable
marked with ``@needs_triton`` is skipped, with the reason, where the kernels cannot run (no
triton, or CPU tensors without the interpreter), instead of failing or crashing collection.
"""
from __future__ import annotations

import importlib

from pytest_precision.kernels.runtime import builtin_enabled, triton_installed, unavailable
from pytest_precision.targets import Target

__all__ = ["needs_triton", "skip_reason", "interpreted", "builtin_targets", "BUILTIN"]

# target name -> (module in pytest_precision.kernels, function, kind)
BUILTIN = {
    "triton.softmax": ("softmax", "softmax", "softmax"),
    "triton.log_softmax": ("softmax", "log_softmax", "log_softmax"),
    "triton.flash_attention": ("flash_attention", "flash_attention", "attention"),
}


def needs_triton(fn):
    """Mark ``fn`` as running Triton kernels (the suites skip it where they cannot run)."""
    fn.needs_triton = True
    return fn


def skip_reason(fn, device: str) -> str | None:
    """Why the suite must skip target callable ``fn`` on ``device``, or None."""
    return unavailable(device) if getattr(fn, "needs_triton", False) else None


def interpreted(fn, device: str) -> bool:
    """Whether ``fn`` runs Triton kernels under the interpreter here (on the CPU): its time is the
    interpreter's, seconds per call and nothing the speed gate should record."""
    return getattr(fn, "needs_triton", False) and not device.startswith("cuda")


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

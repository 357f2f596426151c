"""Name the first operation where precision was lost, and what the exact computation had there.

A counted overflow at the output often shows up as NaN (exp overflows to inf, then inf / inf),
and a -inf from log is usually a probability that underflowed to 0 two ops earlier. The failing
call is re-run traced (``tracing.trace``), and so is the same callable on the float64 inputs
without autocast; the two traces are aligned op by op. The first op that turned finite inputs
into inf or NaN is the fault; the reference's value at that element says what it should have
been. When the fault is a pole (log(0), 1/0), the op whose output underflowed to the 0 is named
as its cause. With no non-finite value at all, the first op whose output is 0 where the
reference's is not is an underflow fault. Runs only for failing cases.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tracing import OpRecord, trace

__all__ = ["Fault", "first_fault", "locate", "align"]

# ops whose inf comes from a zero input (log(0), 1/0): the zero is an underflow upstream
_POLE_OPS = {"log", "log2", "log10", "reciprocal", "div", "rsqrt", "pow", "xlogy"}
# ops that move or re-lay values without computing: skipped when aligning two traces, since
# autocast inserts casts in one run that the float64 run does not have
_LAYOUT_OPS = {"_to_copy", "to", "copy_", "clone", "view", "_unsafe_view", "reshape", "expand", "t", "transpose",
               "permute", "contiguous", "unsqueeze", "squeeze", "slice", "select", "as_strided", "_reshape_alias",
               "empty_like", "zeros_like", "ones_like", "empty", "new_empty", "new_zeros", "fill_", "zero_"}
_ALIGN_WINDOW = 8
# ops whose output is memory, not a value: an uninitialised buffer may hold anything, NaN included
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted", "resize_",
                "set_"}


def _candidate(r: OpRecord) -> bool:
    """Whether ``r`` can be a fault: an op that computes, or a whole interpreted Triton launch;
    neither an allocation nor one of the interpreter's own ops inside a launch."""
    return r.name not in _ALLOCATIONS and (r.kernel is None or r.launch)


@dataclass(frozen=True)
class Fault:
    op: str  # "aten::exp"
    kind: str  # "overflow" | "underflow" | "nan"
    produced: str  # "inf" | "-inf" | "nan" | "0"
    where: str  # "file.py:12" of the user's code, or "?"
    phase: str = "forward"
    reference: float | None = None  # the float64 run's value at the first faulty element
    cause: str | None = None  # for a pole: the op that underflowed to the zero it met
    kernel: str | None = None  # an interpreted Triton kernel the op ran inside (its internals)
    step: int | None = None  # a training step after the first that the fault is in

    def describe(self, config: str | None = None) -> str:
        frm = "from nonzero inputs" if self.produced == "0" else "from finite inputs"
        phase = "" if self.phase == "forward" else f" ({self.phase})"
        under = (f" under {config}" if config else "") + (f" at step {self.step}" if self.step else "")
        if self.kernel is not None:  # the aten ops are the interpreter's own; the kernel is what ran
            s = (f"first {self.kind} inside Triton kernel {self.kernel} (interpreted; launched at {self.where}){phase}"
                 f"{under}: produced {self.produced} {frm}")
            if self.reference is None:
                s += " (its arithmetic runs in numpy, out of the op tracer's sight)"
        else:
            s = f"first {self.kind} in {self.op}{phase} at {self.where}{under}: produced {self.produced} {frm}"
        if self.reference is not None:
            s += f" where the reference is {self.reference:.3g}"
        if self.cause:
            s += f"; {self.cause}"
        return s


def align(run: list[OpRecord], ref: list[OpRecord]) -> dict[int, OpRecord]:
    """Pair the compute ops of two traces of the same callable, in order: each op of ``run`` with
    the next op of the same name in ``ref`` (within a short window). Layout ops are skipped."""
    compute = [r for r in ref if r.name not in _LAYOUT_OPS and _candidate(r)]
    pairs, j = {}, 0
    for r in run:
        if r.name in _LAYOUT_OPS or not _candidate(r):
            continue
        for k in range(j, min(j + _ALIGN_WINDOW, len(compute))):
            if compute[k].name == r.name and compute[k].phase.split(" ")[0] == r.phase.split(" ")[0]:
                pairs[r.index], j = compute[k], k + 1
                break
    return pairs


def _exact(ref: OpRecord | None, shape) -> torch.Tensor | None:
    """The reference op's output when it is a float64 (or, for a target that refused float64, a
    float32) result of the same shape. A callable that casts (``q.half()``) runs that op in 16
    bits in the reference run too: no reference there."""
    if ref is None or ref.output is None or ref.output.dtype not in (torch.float64, torch.float32) \
            or ref.output.shape != shape:
        return None
    return ref.output


def _at(ref: OpRecord | None, mine: OpRecord, mask: torch.Tensor) -> float | None:
    """The reference op's output at the first element of ``mask``."""
    exact = _exact(ref, mask.shape)
    if exact is None:
        return None
    idx = mask.flatten().nonzero()
    return float(exact.flatten()[int(idx[0])]) if idx.numel() else None


def _underflowed(r: OpRecord, ref: OpRecord | None) -> torch.Tensor | None:
    """Elements that are 0 in ``r``'s output but not in the reference's, or None."""
    exact = _exact(ref, r.output.shape) if r.output is not None else None
    if exact is None:
        return None
    mask = (r.output == 0) & (exact.to(r.output.device) != 0)
    return mask if bool(mask.any()) else None


def locate(run: list[OpRecord], ref: list[OpRecord] | None = None) -> Fault | None:
    """The first fault in ``run`` (see the module's docstring); ``ref`` is the float64 trace (or,
    for a target that refused float64, its float32 trace)."""
    pairs = align(run, ref) if ref else {}
    reference_dtype = next((r.out_dtypes[0] for r in ref or () if r.out_dtypes and _candidate(r)
                            and r.out_dtypes[0] in ("float64", "float32")), "float64")
    for r in run:
        # a constant -inf (SDPA's math path makes one with scalar_tensor) or NaN computes nothing
        if not r.nonfinite or not r.inputs_finite or not r.inputs_floating or r.output is None or not _candidate(r):
            continue
        out, ref_op = r.output, pairs.get(r.index)
        bad = ~torch.isfinite(out)
        exact = _exact(ref_op, out.shape)
        # NaN where the exact result is NaN is right (a masked row); the reference says so where it
        # is wider than the run: a float64 op, or a float32 one beside a 16-bit run (a target that
        # refused float64). A float32 run of a float32 case overflows where the case does, and a
        # Triton kernel computes in float32 inside whatever it is given: there the reference
        # value is shown, not trusted
        trusted = exact is not None and not r.launch and (exact.dtype == torch.float64
                                                          or out.dtype in (torch.float16, torch.bfloat16))
        if trusted:
            bad &= torch.isfinite(exact.to(out.device))
        if not bool(bad.any()):
            continue
        if bool((torch.isnan(out) & bad).any()):
            kind, produced, mask = "nan", "nan", torch.isnan(out) & bad
        else:
            produced = "inf" if bool((out == float("inf")).any()) else "-inf"
            mask = (out == float(produced)) & bad
            kind = "underflow" if r.name in _POLE_OPS and r.inputs_zero else "overflow"
        cause = _zero_source(run, r, pairs) if kind == "underflow" else None
        if exact is None and ref_op is not None and ref_op.out_dtypes and ref_op.out_dtypes[0] != reference_dtype:
            cause = (f"the {reference_dtype} run computed it in {ref_op.out_dtypes[0]} too (the callable casts its "
                     "inputs itself, defeating the config), so there is no reference value")
        value = _at(ref_op, r, mask)
        if value is not None and not math.isfinite(value):
            why = ("it computes in float32 inside, whatever it is given, or the exact result is not finite" if r.launch
                   else "not an exact result: the target refused float64")
            cause, value = f"the {reference_dtype} run gave {value:g} there too ({why})", None
        return Fault(r.op, kind, produced, r.where, r.phase, value, cause, r.kernel)
    for r in run:  # nothing went non-finite: the first value lost to 0
        mask = _underflowed(r, pairs.get(r.index))
        if mask is not None and r.name not in _LAYOUT_OPS and _candidate(r):
            return Fault(r.op, "underflow", "0", r.where, r.phase, _at(pairs.get(r.index), r, mask), kernel=r.kernel)
    return None


def _zero_source(run: list[OpRecord], pole: OpRecord, pairs: dict[int, OpRecord]) -> str | None:
    """The latest op before ``pole`` whose output underflowed to 0 against the reference."""
    for r in reversed(run[:pole.index]):
        mask = _underflowed(r, pairs.get(r.index))
        if mask is not None and r.name not in _LAYOUT_OPS and _candidate(r):
            v = _at(pairs.get(r.index), r, mask)
            return (f"the 0 came from {r.op} at {r.where} underflowing"
                    + (f" where the reference is {v:.3g}" if v is not None else ""))
    return None


def first_fault(fn, reference=None) -> Fault | None:
    """Run ``fn()`` traced (and ``reference()``, the same callable on float64 inputs, if given;
    or a sequence of such callables, each traced on its own until one completes) and return the
    first fault, or None. Exceptions from ``fn`` propagate; a reference that raises an Exception
    only costs the reference values (a BaseException, such as the case's time limit, propagates).
    ``fn`` may instead be the records of a run traced already (``tracing``: a training step traced
    from inside the run that reached it)."""
    run = fn if isinstance(fn, list) else trace(fn, keep_outputs=True)
    ref = None
    for attempt in (() if reference is None else (reference,) if callable(reference) else reference):
        try:
            ref = trace(attempt, keep_outputs=True)
            break
        except Exception:  # a target that cannot run in float64 still gets its fault named
            ref = None
    return locate(run, ref)

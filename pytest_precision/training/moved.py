"""What moved when a session's fp32 reference left the one a training golden recorded, in words.

The fp32 reference (the fp32 run's loss and gradient norm at every step, each parameter's gradient
norm at the first step) moves with the model, the data, the optimizer, the training loop or
torch, never with a precision config. A loop change moves it by a recognisable factor: a step that
accumulates N micro-batches and no longer divides their loss by N has exactly N x the gradient
(2.00 x for 2: scaling by a power of two is exact in floating point, so the ratio is 2 to the last
bit; for another N, to fp32's rounding); a ``zero_grad`` inside the accumulation loop keeps only the
last micro-batch's gradient, about 1/N of the sum where the micro-batches' gradients agree (1/sqrt(N)
where they are unrelated), with the first step's loss unchanged (the forward does not see the
gradients); a loss multiplied by a constant moves loss and gradient by the same factor. The
gradients recorded are the ones the optimizer applies, after any clipping, so a newly added
``clip_grad_norm_`` whose max_norm is below the gradients' norm also shrinks the gradient with the
loss unchanged: a reading that fits it names it as the other cause; a loss exactly N x with the
applied gradient unchanged is the undivided loss of N micro-batches whose gradients the clipping
brings back to its max_norm in both runs (the Hugging Face Trainer clips to 1 by default). So the
sentence gives the first step's gradient-norm and loss ratios against the golden's and reads the
factor where it is one of these. N is what the session's fp32 run did: the most backward passes
one parameter accumulated in its first step (``loop_watch``).
"""
from __future__ import annotations

import math

from ..numerics.problem import Problem

__all__ = ["fp32_moved", "ratio_reading", "EXACT_RTOL"]

# an exact factor repeats to fp32's rounding (a few 1e-7) on the machine that recorded the golden,
# and within CROSS_KEY_RTOL's 1e-4 on another machine
EXACT_RTOL = 1e-4


def _percent(now: float, then: float) -> str:
    return "was 0" if then == 0 else f"{100 * (now - then) / abs(then):+.2g} %"


def _close(a, b, rtol: float, scale: float = 0.0) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or abs(a - b) <= rtol * abs(b) + scale  # NaN is never close


def fp32_moved(now: dict, recorded: dict, rtol: float, key: str, micro_batches: int = 1) -> Problem | None:
    """The golden's ``regression`` problem when this session's fp32 reference (``baseline.fp32_reference``) left the one
    ``key`` recorded by more than ``rtol``: the first step's gradient-norm and loss ratios and what
    they read as (``ratio_reading``; ``micro_batches``: the backward passes of this run's first
    step), then the parameters whose first gradient moved most."""
    total = math.sqrt(sum(v * v for v in now["fp32_first_grad_norms"].values()))
    noise = 2.0 ** -24 * total  # a parameter whose gradient is rounding noise moves by its noise
    old = recorded.get("fp32_first_grad_norms") or {}
    moved = []
    for n, v in now["fp32_first_grad_norms"].items():
        w = old.get(n)
        if w is None or not _close(v, w, rtol, noise):
            moved.append((math.inf if w is None or w == 0 else abs(v - w) / abs(w), n, v, w))
    if set(old) - set(now["fp32_first_grad_norms"]):
        moved.append((math.inf, f"{len(set(old) - set(now['fp32_first_grad_norms']))} parameter(s) gone", None, None))
    steps = [(i, a, b) for i, (a, b) in enumerate(zip(now["fp32_loss"], recorded.get("fp32_loss") or []))
             if not _close(a, b, rtol)]
    norms = [(i, a, b) for i, (a, b) in enumerate(zip(now["fp32_grad_norm"], recorded.get("fp32_grad_norm") or []))
             if not _close(a, b, rtol)]
    if not (moved or steps or norms):
        return None
    parts = []
    ratios = first_step_ratios(now, recorded, micro_batches)
    if ratios:
        parts.append(ratios)
    if moved:
        top = sorted(moved, key=lambda t: (-t[0], t[1]))[:3]
        parts.append("first-step gradient norm of " + ", ".join(
            n if v is None else (f"{n} {v:.4g} (new)" if w is None else f"{n} {v:.4g} vs {w:.4g} ({_percent(v, w)})")
            for _, n, v, w in top) + (f" and {len(moved) - 3} more" if len(moved) > 3 else ""))
    if steps:
        i, a, b = steps[0]
        parts.append(f"step {i} loss {a:.7g} vs {b:.7g}")
    elif norms:
        i, a, b = norms[0]
        parts.append(f"step {i} gradient norm {a:.7g} vs {b:.7g}")
    return Problem("golden", "regression", f"the fp32 reference moved against {key}'s (relative tolerance {rtol:g}): "
                   f"{'; '.join(parts)}: the model, data, optimizer, training loop or torch changed the fp32 run "
                   "itself, not its precision")


def _times(r: float) -> str:
    return f"{r:.2f} x" if 0.1 <= abs(r) < 100 else f"{r:.3g} x"


def _exactly(r: float, n: float) -> bool:
    return abs(r - n) <= EXACT_RTOL * abs(n)


def first_step_ratios(now: dict, recorded: dict, micro_batches: int = 1) -> str | None:
    """"first-step gradient norm 2.00 x the golden's, loss 1.00 x: <reading>", at the first step
    both runs applied; None where either lacks it or neither moved."""
    pairs = zip(now.get("fp32_grad_norm") or [], recorded.get("fp32_grad_norm") or [],
                now.get("fp32_loss") or [], recorded.get("fp32_loss") or [])
    step = next(((g, h, a, b) for g, h, a, b in pairs if g is not None and h), None)
    if step is None or not step[3]:
        return None
    grad, loss = step[0] / step[1], step[2] / step[3]
    if not (math.isfinite(grad) and math.isfinite(loss)) or (_exactly(grad, 1.0) and _exactly(loss, 1.0)):
        return None
    reading = ratio_reading(grad, loss, micro_batches)
    return f"first-step gradient norm {_times(grad)} the golden's, loss {_times(loss)}" + (f": {reading}" if reading else "")


def ratio_reading(grad: float, loss: float, micro_batches: int = 1) -> str | None:
    """What a first step's gradient-norm ratio ``grad`` and loss ratio ``loss`` against the golden
    read as, or None (the module docstring)."""
    n = micro_batches
    whole = round(grad) if grad >= 1.5 else None
    if whole is not None and _exactly(grad, whole):
        if n > 1 and whole == n:
            return (f"exactly the {n} micro-batches a step accumulates: the loss is no longer divided by the number "
                    "of micro-batches")
        if whole == 2 and n <= 1:
            return ("exactly 2: the loss is no longer divided by 2, as when a loop of 2 micro-batches no longer divides "
                    "their loss by their number")
        return f"exactly {whole}: the loss (or its gradient) is no longer divided by {whole}"
    part = round(1 / grad) if 0 < grad <= 2 / 3 else None
    if part is not None and _exactly(grad * part, 1.0):
        twice = f" (by the number of micro-batches, {n}, twice)" if part == n else ""
        clipped = (f"; or, with the loss unchanged, gradients now clipped (clip_grad_norm_) to 1/{part} of their norm"
                   if _exactly(loss, 1.0) else "")
        return f"exactly 1/{part}: the loss (or its gradient) is divided by {part} once more{twice}{clipped}"
    if n > 1 and _exactly(loss, 1.0) and 0.5 / n <= grad <= min(0.85, 1.2 / math.sqrt(n)):
        return (f"near 1/{n} to 1/sqrt({n}) for the {n} micro-batches a step accumulates, with the loss unchanged: as "
                "when only the last micro-batch's gradient is kept (zero_grad inside the accumulation loop), or "
                "gradients now clipped (clip_grad_norm_ with a max_norm below their norm)")
    if not _exactly(loss, 1.0) and _exactly(grad / loss, 1.0):
        return f"loss and gradient by the same factor: the loss is multiplied by {loss:.4g}"
    if n > 1 and _exactly(loss, n) and _exactly(grad, 1.0):  # both runs' gradients clipped to max_norm
        return (f"the loss exactly the {n} micro-batches a step accumulates and the applied gradient unchanged: the "
                "loss is no longer divided by the number of micro-batches, and clip_grad_norm_ clips both runs' "
                "gradients to its max_norm")
    return None

"""Whether a run's loss scale keeps its gradients in float16's range, judged without a golden.

A GradScaler multiplies the loss by its scale so that the float16 backward holds gradients that
would otherwise fall below float16's normal range (6.1e-05, where it starts losing bits) or flush
to 0. A scaler stuck low (``GradScaler(init_scale=1.0, growth_interval=1e9)``) runs, skips nothing
and costs little SQNR (the built-in GPT: 58.7 dB against 60.3), so nothing else catches it.

The judgement uses the float64 first step's gradients (the truth the rates use): per parameter,
how many of its significant elements, times the scale the first applied step ran with, fall below
float16's smallest normal, against the same count at the scale a working scaler runs at here:

- torch's default GradScaler starts at 2^16 and grows only every 2000 steps, so in a run of a few
  steps a correct scaler sits at 2^16 (never growing is not itself a defect: it is what a correct
  scaler does over 8 steps, and a scale that loses nothing is enough);
- it backs off only on an overflow, so it runs lower only where the gradients overflow: at the
  largest power of two that keeps the float64 first-step gradients finite in float16, and below
  any scale the run itself skipped a step at (an overflow the parameters' gradients do not show,
  in an activation's, counts too).

The working scale is the least of the three. A case fails when the run's scale pushes more than
5 % of some parameter's significant gradients below the normal range that the working scale keeps
(counted in elements, past a count's spread between machines: ``limits.limit_count``). On the
built-in GPT a scale of 1 puts 8588 of blocks.1.qkv.weight's 12288 gradients there (20792 of all
134144); 2^12 puts 11 (17 in all), 2^16 none.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..numerics.formats import format_of
from .compare import significant
from .configs import GRAD_SCALER_INIT_SCALE, TrainConfig
from .limits import UNDERFLOW_LIMIT, count_text, limit_count

__all__ = ["ScaleHealth", "scale_health", "scale_problem", "working_scale"]

FP16 = format_of(torch.float16)


@dataclass
class ScaleHealth:
    """The loss scale of a float16 run against a working scaler's, counted on the float64 first
    step's gradients (plain values)."""

    step: int  # the first applied step, whose scale is judged
    scale: float  # the loss scale it ran with
    working: float  # the scale a working scaler runs at here (the module docstring)
    finite_up_to: float  # the largest power of two keeping the float64 gradients finite in float16
    history: list[float | None]  # the scale each step ran with
    below: dict[str, int] = field(default_factory=dict)  # per parameter: below the normal range at ``scale``
    below_working: dict[str, int] = field(default_factory=dict)  # the same at ``working``
    elements: dict[str, int] = field(default_factory=dict)  # significant elements per parameter
    flushed: int = 0  # in all, below half float16's smallest subnormal at ``scale`` (0 in float16)
    truth: str = "float64"

    def past_limit(self) -> tuple[str, int, int] | None:
        """The parameter furthest past the 5 % limit in gradients the lower scale pushes below the
        normal range: (name, count at ``scale`` less the count at ``working``, elements), or None."""
        worst = None
        for n, total in self.elements.items():
            count = self.below.get(n, 0) - self.below_working.get(n, 0)
            if count / total > UNDERFLOW_LIMIT and count > limit_count(UNDERFLOW_LIMIT, total):
                if worst is None or count / total > worst[1] / worst[2]:
                    worst = (n, count, total)
        return worst


def _power_of_two(x: float) -> float:
    return 2.0 ** math.floor(math.log2(x))


def working_scale(exact: dict[str, torch.Tensor], scales_used: list[float | None], skipped: list[int]) -> tuple[float, float]:
    """(the scale a working scaler runs at, the largest power of two keeping ``exact`` finite in
    float16): the module docstring."""
    top = max((float(g.double().abs().max()) for g in exact.values() if g.numel()), default=0.0)
    finite = _power_of_two(FP16.max / top) if 0 < top < math.inf else math.inf  # a non-finite one: no bound
    overflowed = [scales_used[i] for i in skipped if i < len(scales_used) and scales_used[i]]
    return min([GRAD_SCALER_INIT_SCALE, finite] + [s / 2 for s in overflowed]), finite


def scale_health(config: TrainConfig, scales_used: list[float | None], first: int | None, skipped: list[int],
                 exact: dict[str, torch.Tensor], truth: str = "float64") -> ScaleHealth | None:
    """The loss scale of a run computing in float16 with a scaler, against a working scaler's; None
    for a run in another format, without a scaler, or with no applied step."""
    if config.compute_dtype != torch.float16 or first is None or first >= len(scales_used) or not scales_used[first]:
        return None
    scale = scales_used[first]
    working, finite = working_scale(exact, scales_used, skipped)
    h = ScaleHealth(first, scale, working, finite, list(scales_used), truth=truth)
    for n, g in exact.items():
        sig = significant(g)
        total = int(sig.sum())
        if not total:
            continue
        a = g.double().abs()
        h.elements[n] = total
        h.below[n] = int((sig & (a * scale < FP16.smallest_normal)).sum())
        h.below_working[n] = int((sig & (a * working < FP16.smallest_normal)).sum())
        h.flushed += int((sig & (a * scale < FP16.smallest_subnormal / 2)).sum())
    return h


def _scale(s: float | None) -> str:
    return "-" if s is None else f"{s:g}"


def power_text(s: float) -> str:
    """A power of two as ``2^k`` (65536 stays as torch prints it), else as it is."""
    k = math.log2(s) if 0 < s < math.inf else None
    return f"2^{int(k)}" if k is not None and k == int(k) and s != GRAD_SCALER_INIT_SCALE else f"{s:g}"


def history_text(h: ScaleHealth) -> str:
    shown = ", ".join(_scale(s) for s in h.history)
    ran = [s for s in h.history if s]
    never = len(ran) > 1 and max(ran) <= min(ran)
    return f"{shown}{', never grew' if never else ''}"


def scale_problem(h: ScaleHealth | None) -> str | None:
    """The failure sentence when the run's scale loses what a working scaler keeps, or None."""
    if h is None or h.scale >= h.working:
        return None
    worst = h.past_limit()
    if worst is None:
        return None
    name, count, total = worst
    below, below_working, elements = sum(h.below.values()), sum(h.below_working.values()), sum(h.elements.values())
    return (f"loss scale {h.scale:g} at step {h.step} (history {history_text(h)}) leaves {count_text(count, total)} of "
            f"{name}'s {h.truth} first-step gradients below float16's normal range ({FP16.smallest_normal:.2g}) that "
            f"{h.working:g}, the scale a working GradScaler runs at here, keeps in it > {100 * UNDERFLOW_LIMIT:g} % allowed "
            f"(up to {limit_count(UNDERFLOW_LIMIT, total)} elements); in all {below} of {elements} significant gradients "
            f"below it at {h.scale:g} ({h.flushed} flushed to 0), {below_working} at {h.working:g}; {working_why(h)}")


def working_why(h: ScaleHealth) -> str:
    """Why the working scale is what it is, in a clause."""
    if h.working >= GRAD_SCALER_INIT_SCALE:
        return (f"torch's default GradScaler starts at {GRAD_SCALER_INIT_SCALE:g} and backs off only on an overflow, "
                f"and these gradients stay finite in float16 up to {power_text(h.finite_up_to)}: use the default GradScaler, "
                "or one that grows (growth_interval) from a lower init_scale")
    if h.working >= h.finite_up_to:
        return (f"{h.working:g} is the largest power of two that keeps these gradients finite in float16, where a "
                "default GradScaler backs off to")
    return f"{h.working:g} is half the lowest scale the run skipped a step at (an overflow)"

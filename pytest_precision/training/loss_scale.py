"""Whether a run's loss scale keeps its gradients in float16's range, judged without a golden.

A GradScaler multiplies the loss by its scale so that the float16 backward holds gradients that
would otherwise fall below float16's normal range (6.1e-05, where it starts losing bits) or flush
to 0. A scaler stuck low (``GradScaler(init_scale=1.0, growth_interval=1e9)``) runs, skips nothing
and costs little SQNR (the built-in GPT: 58.7 dB against 60.3), so nothing else catches it.

The judgement uses the float64 first step's gradients (the truth the rates use): per parameter,
how many of its significant elements, times the judged scale, fall below float16's smallest
normal, against the same count at the scale a working scaler runs at here. The judged scale is the
largest one an applied step of the run ran with: the scale the run reached. A scaler that grows
from a low ``init_scale`` (``growth_interval=1``) trains at what it reached from there on, and a
default one that backed off after overflows at what it backed off to; one stuck low reaches
nothing more than its first step's. The first step's gradients stand for that later step's (a few
steps move their magnitudes little), and the message says which step's scale it judged. A step
that no GradScaler scaled (``loss.backward()`` without ``scaler.scale``) ran at 1 (``run``'s
``Trajectory.unscaled``), and the message says so.

The working scale:

- torch's default GradScaler starts at 2^16 and grows only every 2000 steps, so in a run of a few
  steps a correct scaler sits at 2^16 (never growing is not itself a defect: it is what a correct
  scaler does over 8 steps, and a scale that loses nothing is enough);
- it backs off only on an overflow, so it runs lower only where the gradients overflow: at the
  largest power of two that keeps the float64 first-step parameter gradients finite in float16
  (a bound from the parameters' gradients only: an activation's gradient, which the float64 step
  does not keep, can overflow at a lower scale), and below any scale the run itself skipped a step
  at (that is where an activation's overflow shows).

The working scale is the least of the three. A case fails when the judged scale pushes more than
5 % of some parameter's significant gradients below the normal range that the working scale keeps
(counted in elements, past a count's spread between machines: ``limits.limit_count``). On the
built-in GPT a scale of 1 puts 8588 of blocks.1.qkv.weight's 12288 gradients there (20792 of all
134144); 2^12 puts 11 (17 in all), 2^16 none.

On the suite's small regression model (loss x 1e-2, 4 steps) a ``GradScaler(init_scale=1.0,
growth_interval=1)`` runs at 1, 2, 4, 8 and fails at the 8 it reached (49 of fc1.weight's 512
gradients, 9.57 %, below the range); from 16 it reaches 128, where 3 of 808 are below, and passes. The
same model stepped with ``loss.backward()`` and no scaler fails as a scaler stuck at 1 does (336 of
512, 65.6 %).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..numerics.formats import format_of
from ..numerics.problem import Problem
from .compare import significant
from .configs import GRAD_SCALER_INIT_SCALE, TrainConfig
from .limits import UNDERFLOW_LIMIT, count_text, limit_count

__all__ = ["ScaleHealth", "scale_health", "scale_problem", "working_scale", "judged_step", "history_text"]

FP16 = format_of(torch.float16)


@dataclass
class ScaleHealth:
    """The loss scale of a float16 run against a working scaler's, counted on the float64 first
    step's gradients (plain values)."""

    step: int  # the applied step whose scale is judged: the first that ran with the largest scale
    scale: float  # the loss scale it ran with (the scale the run reached)
    working: float  # the scale a working scaler runs at here (the module docstring)
    finite_up_to: float  # the largest power of two keeping the float64 parameter gradients finite in float16
    history: list[float | None]  # the scale each step ran with
    below: dict[str, int] = field(default_factory=dict)  # per parameter: below the normal range at ``scale``
    below_working: dict[str, int] = field(default_factory=dict)  # the same at ``working``
    elements: dict[str, int] = field(default_factory=dict)  # significant elements per parameter
    flushed: int = 0  # in all, below half float16's smallest subnormal at ``scale`` (0 in float16)
    truth: str = "float64"
    first: int = 0  # the first applied step (whose gradients the float64 step has)
    unscaled: list[int] = field(default_factory=list)  # steps no GradScaler scaled (run at 1)

    @property
    def never_scaled(self) -> bool:
        """Whether no GradScaler scaled the loss at any step (``loss.backward()`` alone)."""
        return len(self.unscaled) == len(self.history) > 0

    @property
    def grew(self) -> bool:
        """Whether the judged scale is above the first applied step's."""
        return self.scale > (self.history[self.first] or 0)

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


def judged_step(scales_used: list[float | None], first: int, skipped: list[int]) -> int:
    """The applied step (from ``first``, not skipped) that first ran with the largest scale."""
    applied = [i for i in range(first, len(scales_used)) if i not in skipped and scales_used[i]]
    return max(applied, key=lambda i: (scales_used[i], -i))


def scale_health(config: TrainConfig, scales_used: list[float | None], first: int | None, skipped: list[int],
                 exact: dict[str, torch.Tensor], truth: str = "float64", unscaled: list[int] = ()) -> ScaleHealth | None:
    """The loss scale a run computing in float16 with loss scaling reached, against a working
    scaler's; None for a run in another format, without loss scaling, or with no applied step.
    ``unscaled``: the steps no GradScaler scaled (recorded at 1)."""
    if config.compute_dtype != torch.float16 or first is None or first >= len(scales_used) or not scales_used[first]:
        return None
    step = judged_step(scales_used, first, skipped)
    scale = scales_used[step]
    working, finite = working_scale(exact, scales_used, skipped)
    h = ScaleHealth(step, scale, working, finite, list(scales_used), truth=truth, first=first, unscaled=list(unscaled))
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


def _steps(steps: list[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(str(i) for i in steps)


def history_text(h: ScaleHealth) -> str:
    """The scale of each step, and whether it never grew or no GradScaler scaled the loss."""
    shown = ", ".join(_scale(s) for s in h.history)
    if h.never_scaled:
        return f"{shown}: no GradScaler scaled the loss"
    ran = [s for s in h.history if s]
    never = len(ran) > 1 and max(ran) <= min(ran)
    unscaled = f"; no GradScaler scaled the loss at {_steps(h.unscaled)}" if h.unscaled else ""
    return f"{shown}{', never grew' if never else ''}{unscaled}"


def judged_text(h: ScaleHealth) -> str:
    """Which scale is judged: "loss scale 1 at step 0 (history ...)", or the one a growing scaler reached."""
    if h.never_scaled:
        return (f"loss scale 1 at step {h.step} (no GradScaler scaled the loss at any step: loss.backward() without "
                "scaler.scale(loss))")
    if h.grew:
        return (f"loss scale {h.scale:g} at step {h.step}, the largest the run reached (from {h.history[h.first]:g} at "
                f"step {h.first}; history {history_text(h)}), still")
    return f"loss scale {h.scale:g} at step {h.step} (history {history_text(h)})"


def scale_problem(h: ScaleHealth | None) -> Problem | None:
    """The ``underflow`` problem when the scale the run reached loses what a working scaler keeps, or None."""
    if h is None or h.scale >= h.working:
        return None
    worst = h.past_limit()
    if worst is None:
        return None
    name, count, total = worst
    below, below_working, elements = sum(h.below.values()), sum(h.below_working.values()), sum(h.elements.values())
    return Problem("oracle", "underflow", f"{judged_text(h)} leaves {count_text(count, total)} of {name}'s {h.truth} first-step gradients below "
            f"float16's normal range ({FP16.smallest_normal:.2g}) that {h.working:g}, the scale a working GradScaler runs at "
            f"here, keeps in it > {100 * UNDERFLOW_LIMIT:g} % allowed (up to {limit_count(UNDERFLOW_LIMIT, total)} "
            f"elements); in all {below} of {elements} significant gradients below it at {h.scale:g} ({h.flushed} flushed "
                   f"to 0), {below_working} at {h.working:g}; {working_why(h)}{advice(h)}")


def working_why(h: ScaleHealth) -> str:
    """Why the working scale is what it is, in a clause."""
    if h.working >= GRAD_SCALER_INIT_SCALE:
        return (f"torch's default GradScaler starts at {GRAD_SCALER_INIT_SCALE:g} and backs off only on an overflow, "
                f"and these parameter gradients stay finite in float16 up to {power_text(h.finite_up_to)} (an "
                "activation's gradient can overflow lower, where a step would be skipped)")
    if h.working >= h.finite_up_to:
        return (f"{h.working:g} is the largest power of two that keeps these parameter gradients finite in float16, "
                "where a default GradScaler backs off to")
    return f"{h.working:g} is half the lowest scale the run skipped a step at (an overflow)"


def advice(h: ScaleHealth) -> str:
    """What to do, after a colon, or nothing where the working scale is lower than torch's default."""
    if h.never_scaled:
        return (": scale the loss with the GradScaler the step is handed (scaler.scale(loss).backward(), "
                "scaler.step(optimizer), scaler.update())")
    if h.grew:
        return (f": the scaler grows, but over these {len(h.history)} steps not to a scale that keeps them; start it "
                f"higher (init_scale; torch's default is {GRAD_SCALER_INIT_SCALE:g})")
    if h.working >= GRAD_SCALER_INIT_SCALE:
        return ": use the default GradScaler, or one that grows (growth_interval) from a lower init_scale"
    return ""

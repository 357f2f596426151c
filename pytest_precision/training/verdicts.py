"""The absolute verdicts of a training config's run: against the fp32 run of the session and the
float64 step, with floors from the compute format's mantissa bits (``limits``) and the model's own
conditioning (``compare.group_floors``). A later step's limit grows by the larger of two drifts
(``LaterSteps``): fp32's own from the float64 run (``drift``), and, for a ``step_fn``, the careful
loop's own from its fp32 run (``peer``): what the model's dynamics make of the config's rounding on
the same steps; and no step's limit on a group is tighter than the group's first-step floor (its
conditioning can leave the format less than the later-step floor: the first step is held to what
it keeps, and the steps after it too). A group with nothing left to judge at the first step
(``TrainMetrics.unresolved``) is judged at no later step: its error only grows from noise. Each verdict is a ``Problem``; a config that exists to show a failure mode (its
``shows``: amp-fp16 without a scaler shows underflow, pure bf16 lost updates) reports it as a detail
instead, and the regression budget holds it where it was accepted.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..numerics.budgets import GRAD_PEER_FACTOR
from ..numerics.problem import Problem
from .compare import TrainMetrics, unresolved_reason
from .configs import TrainConfig
from .drift import Drift, noise_driven
from .fp8 import Fp8Counts, fp8_problems
from .limits import (UNDERFLOW_LIMIT, UPDATE_LOST_LIMIT, UPDATE_RATIO_BAND, db_to_error, error_to_db,
                     first_step_floor_db, grad_norm_band, later_step_floor_db, limit_problem)
from .loss_precision import LowPrecisionLoss
from .loss_scale import ScaleHealth, scale_problem
from .peer import LoopPeer, loop_rounding, peer_budget

__all__ = ["RunVerdict", "judge_run", "LaterSteps"]

_LOSS_CATEGORIES = ("accuracy", "overflow", "nan", "underflow")  # what a loss computed in 16 bits can cause


@dataclass
class RunVerdict:
    """What the absolute checks found: problems, and the lines the case's details add."""

    problems: list[Problem] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def add(self, category: str, sentence: str) -> None:
        self.problems.append(Problem("oracle", category, sentence))

    def shown_or_failed(self, c: TrainConfig):
        """A check's result as a problem, or, where the config shows it (``c.shows``), a detail."""
        def record(key: str, category: str, sentence: str, limit: str) -> None:
            if key in c.shows:
                self.details.append(f"{c.id} shows this: {sentence} (reported, not held to {limit}; the regression "
                                    "budget holds it where it was accepted)")
            else:
                self.add(category, sentence)
        return record


@dataclass
class LaterSteps:
    """What a later step's limit grows by: the larger of fp32's drift from the float64 run (``fp32``)
    and the careful loop's from its fp32 run (``careful``, after the first applied step ``first``),
    each times its ``Drift.multiple``; and the clause that says which, and by how much."""

    fp32: Drift | None
    careful: Drift | None = None
    loop: str = "standard_step"
    first: int | None = None

    def allowance(self, step: int, pick) -> tuple[float, Drift | None]:
        """``pick(drift)`` of the drift that allows more at ``step``, and that drift (None: neither)."""
        a = pick(self.fp32) if self.fp32 is not None else 0.0
        b = (pick(self.careful) if self.careful is not None and self.first is not None and step > self.first
             else 0.0)
        if math.isfinite(b) and b > a:  # a careful loop that overflowed later says nothing of the limit
            return b, self.careful
        return a, (self.fp32 if a else None)

    def clause(self, step: int, allowance: float, source: Drift | None, base: float, what: str = "",
               shown=None) -> str:
        """Why a later step's limit grew; nothing where it moved the limit ``base`` by less than 1 %."""
        if source is None or not allowance >= 0.01 * base:
            return ""
        drift = allowance / source.multiple
        value = f"{shown(drift):.3g}" if shown else f"{drift:.3g}"
        if source is self.careful:
            return (f"; the careful loop ({self.loop}) itself had left its fp32 run by {what}{value} by step {step} "
                    f"on the same model and steps, and the limit grows by {source.multiple:g} x that")
        return (f"; fp32 itself had left the float64 run by {what}{value} by step {step}, and its limit grows by "
                f"{source.multiple:g} x that")


def _about_one_over(ratio: float, scale: float | None) -> bool:
    """Whether ``ratio`` is within 8 x of 1 / the loss scale ``scale``; only for a scale of 64 or
    more, where 1 / scale is 8 x below the ratios a correct step's bands allow (a step that ran at
    1, with no scaler, has no scale to read)."""
    return bool(scale) and scale >= 64 and 0 < ratio and abs(math.log2(ratio * scale)) < 3


def _clip_cause(m: TrainMetrics, ratio: float) -> str:
    """Why the applied gradients are far from fp32's, when a loss scale explains it: far larger,
    about the scale (the optimizer stepped on gradients never unscaled); far smaller, clipped or
    changed before ``unscale_``."""
    scale = next((s for s in m.scales_used if s), None)
    if ratio > 2 and _about_one_over(1 / ratio, scale):
        return (f", about the loss scale {scale:g}: the optimizer applied gradients still multiplied by it; step "
                "through the scaler (scaler.step(optimizer), which unscales first) or call "
                "scaler.unscale_(optimizer) before optimizer.step()")
    ran = [i for i, r in enumerate(m.grad_norm_ratio) if r is not None]
    scaled = [m.grad_norms[i] * m.scales_used[i] for i in ran if i < len(m.scales_used) and m.scales_used[i]]
    if not scaled or not ratio < 0.5:
        return ""
    if max(scaled) == 0:  # nothing was clipped: nothing reached the optimizer
        return ": every gradient the optimizer applied is 0"
    scale = next(s for s in m.scales_used if s)
    same = len(scaled) > 1 and max(scaled) <= 1.01 * min(scaled)
    if same:  # clip_grad_norm_ on the scaled gradients leaves norm c; unscale_ then divides by the scale
        # clipped per micro-batch (inside an accumulation loop) the direction moves as well
        direction = (f"fp32's direction (cosine {m.grad_cosine:.4f})" if m.grad_cosine >= 0.99
                     else f"a cosine of {m.grad_cosine:.4f} with fp32's")
        return (f": the applied gradients have {direction} and norm "
                f"{scaled[0]:.3g} / the loss scale at every step: they were clipped to norm {scaled[0]:.3g} before "
                "scaler.unscale_(optimizer), which then divided them by the scale; clip after unscale_")
    if _about_one_over(ratio, scale):
        return (f", about 1 / the loss scale {scale:g}: the gradients were clipped or changed before "
                "scaler.unscale_(optimizer)")
    return ""


def judge_run(m: TrainMetrics, c: TrainConfig, scale: ScaleHealth | None, fp8: Fp8Counts | None,
              low_precision_loss: LowPrecisionLoss | None = None, peer: LoopPeer | str | None = None) -> RunVerdict:
    """The absolute verdicts of one config's run against fp32 and the float64 step (the module
    docstring), and a ``step_fn``'s first step against the careful loop's (``peer``: ``training.peer``;
    a string says why it could not run); a loss computed in 16 bits is named in the first verdict on
    the loss or gradients."""
    verdict = RunVerdict()
    add, shown_or_failed = verdict.add, verdict.shown_or_failed(c)
    if m.first_nonfinite is not None:
        step, what = m.first_nonfinite
        value = m.losses[step]
        cat = "overflow" if math.isinf(value) or what != "loss" else "nan"
        where = "" if what == "loss" else ", a step the GradScaler did not skip"
        add(cat, f"non-finite {what} at step {step} (loss {value:g}){where}")
    finite = m.first_nonfinite is None
    judged = _judged_steps(m, c, verdict.details)
    later = _later_steps(m, peer, verdict.details)
    loss_widened = [later.allowance(i, lambda d: d.loss_allowance(i)) for i in range(m.steps)]
    loss_allowed = [c.loss_rtol + w for w, _ in loss_widened]
    over = [(d - loss_allowed[i], i) for i, d in enumerate(m.loss_deviation)
            if i in judged and d is not None and not d <= loss_allowed[i]]
    if c.id != "fp32" and over and finite:
        worst = max(over, key=lambda o: (o[0], -o[1]))[1]  # the first of equals
        shown_or_failed("underflow", "accuracy", f"loss deviates from fp32 by {m.loss_deviation[worst]:.3g} (relative) "
                        f"at step {worst} > {_allowed(loss_allowed[worst], c.loss_rtol)} allowed for {c.id}"
                        f"{later.clause(worst, *loss_widened[worst], c.loss_rtol)}", "the loss limit")
    if c.id != "fp32" and finite:
        _judge_gradients(m, c, shown_or_failed, judged, later, verdict.details)
        _judge_against_peer(m, c, peer, verdict)
    if m.unresolved and c.id != "fp32":
        groups = ", ".join(f"{g} ({v:.3g} dB)" for g, v in sorted(m.unresolved.items()))
        verdict.details.append(f"gradient SQNR not judged at step {_first_applied(m)} or later in {groups}: "
                               f"{unresolved_reason(c.precision_name)}")
    low, high = UPDATE_RATIO_BAND
    if m.update_ratio is not None and not low <= m.update_ratio <= high:
        s = f"the parameter update is {m.update_ratio:.3g} x the fp32 update (median over steps)"
        loss_scale = next((x for x in m.scales_used if x), None)
        if m.update_ratio < low and _about_one_over(m.update_ratio, loss_scale):
            s += (f", about 1 / the loss scale {loss_scale:g}: the gradients were clipped or changed before "
                  "scaler.unscale_(optimizer)")
        shown_or_failed("update_size", "accuracy", s, f"the band {low:g} to {high:g}")
    for key, rates, elements, limit, word, cat in (
            ("underflow", m.underflow_rate, m.underflow_elements, UNDERFLOW_LIMIT, "gradient-underflow rate", "underflow"),
            ("update_lost", m.update_lost_rate, m.update_elements, UPDATE_LOST_LIMIT, "update-lost rate", "accuracy")):
        problem = limit_problem(word, rates, elements, limit, cat)
        if problem:
            shown_or_failed(key, cat, problem.sentence, f"the {100 * limit:g} % limit")
    if low_precision_loss is not None:
        first = next((k for k, p in enumerate(verdict.problems) if p.category in _LOSS_CATEGORIES), None)
        if first is not None:
            p = verdict.problems[first]
            verdict.problems[first] = dataclasses.replace(p, sentence=p.sentence + low_precision_loss.clause())
    if fp8 is not None:  # a float8 recipe's casts (training.fp8)
        verdict.problems += fp8_problems(fp8)
    problem = scale_problem(scale)
    if problem:
        shown_or_failed("underflow", problem.category, problem.sentence, f"the {100 * UNDERFLOW_LIMIT:g} % limit")
    return verdict




def _later_steps(m: TrainMetrics, peer: LoopPeer | str | None, details: list[str]) -> LaterSteps:
    """What later steps' limits grow by: fp32's drift, and the careful loop's where it skipped the
    steps this run skipped (else its steps are not this run's, said in the details)."""
    first = _first_applied(m)
    if not isinstance(peer, LoopPeer) or peer.drift is None:
        return LaterSteps(m.drift, first=first)
    if peer.skipped != list(m.skipped):
        details.append(f"later steps not widened by the careful loop's drift: it skipped steps "
                       f"{', '.join(map(str, peer.skipped)) or 'none'} where this run skipped "
                       f"{', '.join(map(str, m.skipped)) or 'none'}, so its steps are not this run's")
        return LaterSteps(m.drift, first=first)
    return LaterSteps(m.drift, peer.drift, peer.loop, max(first if first is not None else 0, peer.step))


def _first_applied(m: TrainMetrics) -> int | None:
    return next((i for i, r in enumerate(m.grad_norm_ratio) if r is not None), None)


def _judged_steps(m: TrainMetrics, c: TrainConfig, details: list[str]) -> range:
    """The steps judged against fp32: all, or only the first where the trajectory after it is driven
    by rounding noise (training.drift.noise_driven), said in the details."""
    first = _first_applied(m)
    if c.id == "fp32" or first is None or not noise_driven(m.first_update_db, m.fp32_first_update_db):
        return range(m.steps)
    details.append(f"steps after {first} not judged against fp32: fp32's own first update is "
                           f"{m.fp32_first_update_db:.3g} dB from the float64 step's, no clearer than {c.id}'s "
                           f"{m.first_update_db:.3g} dB, so every run's later steps follow its rounding noise (an "
                           "optimizer with a tiny eps turns the noise of a gradient that is exactly 0 into full-size "
                           "steps); the first step, the rates and the golden judge this run")
    return range(first + 1)


def _judge_gradients(m: TrainMetrics, c: TrainConfig, shown_or_failed, judged: range, later_steps: LaterSteps,
                     details: list[str]) -> None:
    """Gradient SQNR (first and worst step), gradient-norm ratio and final-parameter SQNR against
    the floors of the compute format, later steps' widened (``LaterSteps``); a config that shows
    underflow reports them."""
    bits, name = c.mantissa_bits, c.precision_name
    first, later = first_step_floor_db(bits), later_step_floor_db(bits)
    floors = {g: min(first, m.group_floor_db.get(g, first)) for g in m.group_grad_sqnr_db}
    low, high = grad_norm_band(bits, min(floors.values(), default=None))
    norm_over = []
    for i, r in enumerate(m.grad_norm_ratio):
        if i not in judged:
            continue
        widen, source = later_steps.allowance(i, lambda d: d.norm_allowance(i))
        excess = (max(math.log(r) - math.log(high), math.log(low) - math.log(r)) - widen
                  if r is not None and 0 < r < math.inf else (math.inf if r is not None else -math.inf))
        if excess > 0:
            norm_over.append((excess, i, widen, source))
    if norm_over:
        _, step, widen, source = max(norm_over, key=lambda o: (o[0], -o[1]))
        ratio = m.grad_norm_ratio[step]
        clause = later_steps.clause(step, widen, source, math.log(high), "its gradient norm by a factor ", math.exp)
        band = (f"{low:.3g} to {high:.3g} in {name}" if not clause else
                f"{low * math.exp(-widen):.3g} to {high * math.exp(widen):.3g} in {name}{clause}")
        shown_or_failed("underflow", "accuracy", f"gradient norm {ratio:.3g} x fp32's at step {step} (a correct step "
                        f"stays within {band}){_clip_cause(m, ratio)}", "the band")
    bad = {g: v for g, v in m.group_grad_sqnr_db.items() if not v >= floors[g]}
    later_over = []  # (excess error, step, group, SQNR, the least SQNR allowed there, widening, its drift)
    gross: dict[int, list[str]] = {}  # step -> groups where the careful loop kept nothing of the gradient
    for i, groups in m.grad_sqnr_by_step.items():
        if i not in judged:
            continue
        for g, db in groups.items():
            if g in m.unresolved:  # noise at the first step (the module docstring)
                continue
            widen, source = later_steps.allowance(i, lambda d: d.grad_allowance(i, g))
            # never held tighter than the group's first step: where the model's own conditioning leaves
            # the format less than the later-step floor (fp32 itself far from the float64 step), its
            # first-step floor is what a correct step keeps, then and after
            allowed = max(db_to_error(later), db_to_error(floors[g])) + widen
            if allowed >= 1.0 and source is later_steps.careful:
                gross.setdefault(i, []).append(g)
            if not math.isnan(db) and db_to_error(db) > allowed:
                later_over.append((db_to_error(db) - allowed, i, g, db, error_to_db(allowed), widen, source))
    if gross:
        where = "; ".join(f"step {i}: {', '.join(gs)}" for i, gs in sorted(gross.items()))
        details.append(f"the careful loop ({later_steps.loop}) itself kept nothing of the gradient by then ({where}): "
                       "there only an error larger than the gradient fails")
    clause = ""
    if bad or later_over:
        parts = [f"{v:.3g} dB in {g} at the first step < {floors[g]:.3g} dB" for g, v in sorted(bad.items())]
        if later_over:
            _, step, group, db, allowed_db, widen, source = max(later_over, key=lambda o: (o[0], -o[1]))
            if not (step == _first_applied(m) and group in bad):
                parts.append(f"{db:.3g} dB in {group} at step {step} < {allowed_db:.3g} dB{_error_in(m, step, group)}")
                clause = later_steps.clause(step, widen, source, db_to_error(later), "a gradient error of ")
        shown_or_failed("underflow", "accuracy", f"gradient SQNR {', '.join(parts)}, what {name} keeps in a correct "
                        f"step{clause}", "the format's floors")
    last = m.steps - 1
    widen, source = later_steps.allowance(last, lambda d: d.params_allowance)
    params_allowed = db_to_error(later) + widen
    if len(judged) == m.steps and not (math.isnan(m.param_sqnr_db) or db_to_error(m.param_sqnr_db) <= params_allowed):
        shown_or_failed("underflow", "accuracy", f"final-parameter SQNR {m.param_sqnr_db:.3g} dB < "
                        f"{error_to_db(params_allowed):.3g} dB, what {name} keeps in a correct run"
                        f"{later_steps.clause(last, widen, source, db_to_error(later), 'a parameter error of ')}",
                        "the format's floor")


def _error_in(m: TrainMetrics, step: int | None, group: str) -> str:
    """Which parameter of ``group`` holds most of the gradient error at ``step``, as a clause."""
    name = m.grad_error_in.get(step, {}).get(group) if step is not None else None
    return f" (most of it in {name})" if name and (group != name) else ""


def _judge_against_peer(m: TrainMetrics, c: TrainConfig, peer: LoopPeer | str | None, verdict: RunVerdict) -> None:
    """The step_fn's first-step gradient per group against the careful loop's error (``training.peer``)."""
    if peer is None:
        return
    if isinstance(peer, str):
        verdict.details.append(f"the step_fn's loop was not compared with the careful loop: {peer}; the format's "
                               "floors judge its gradients alone")
        return
    over = []  # (excess ratio, group, SQNR, allowed SQNR)
    for g, db in m.group_grad_sqnr_db.items():
        allowed = peer_budget(peer, g, c)
        if g not in m.unresolved and not math.isnan(db) and db_to_error(db) > allowed:
            over.append((db_to_error(db) / allowed, g, db, error_to_db(allowed)))
    if not over:
        return
    _, group, db, allowed_db = max(over, key=lambda o: (o[0], o[1]))
    verdict.add("accuracy", f"gradient SQNR {db:.3g} dB in {group} at the first step < {allowed_db:.3g} dB, what the "
                f"step_fn's loop may lose: the careful loop ({peer.loop}) keeps {peer.sqnr_db(group):.3g} dB of it on the "
                f"same model, loss, batch and config, and a loop is allowed {GRAD_PEER_FACTOR:g} x its error plus one "
                f"rounding of {c.precision_name} ({loop_rounding(c):.3g}); the step_fn loses precision the model does not "
                "(a cast of its gradients to a coarser format, say)")


def _allowed(allowed: float, base: float) -> str:
    return f"{base:g}" if allowed == base else f"{allowed:.3g}"


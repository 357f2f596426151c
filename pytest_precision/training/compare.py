"""A training run against the fp32 run from the same seed, and its first step against the float64
step: the metrics the training suite judges.

Against the fp32 run (each step on the same batch): the relative loss deviation per step; the
gradient-norm ratio per step; the SQNR of the gradients per optimizer parameter group, at the
first step the optimizer ran (same weights, same batch: the config's own error) and at the worst
step (later steps add the divergence of the two trajectories); the SQNR of the final parameters
and of the total update (final minus initial, against fp32's); the update size ratio.

Against the float64 step (the truth): which gradients underflowed and which updates were lost.
An element counts only where the exact value is *significant*: above the format's underflow
threshold at the loop's loss scale, and above the rounding noise of a sum that cancels (2^-24 of
the tensor's largest exact value). A parameter whose exact gradient is 0, such as the key part of
an attention bias (softmax ignores a constant added to a query's scores), holds about 1e-18 of
rounding noise in float64, 1e-11 to 1e-9 in fp32, and 0 or noise in 16 bits: it is not counted.
Lost gradients whose exact value is below the format's range are counted apart (reported, not a
defect of the code: the format cannot hold them).

A parameter group's floor at the first step comes from the model too: fp32's own SQNR there against
the float64 step, less 6.02 dB per mantissa bit the config lacks, is what the config's format can
keep of that group (``resolvable_db``). Where that is below the format's floor (a group whose
exact gradient is tiny beside the terms it sums, as a residual scalar beside zero-initialised
blocks behind a scale-invariant norm, whose exact gradient is 0 or the norm's eps), the floor is
that less the margin; where nothing is left of it (0 dB or less), the group is not judged at that
step (``TrainMetrics.unresolved``, said in the case's details): every run holds noise there.

A model's own conditioning, measured: ``nn.TransformerDecoderLayer`` (ReLU) under amp-fp16 keeps 44.1
dB, where fp32 keeps 133 dB against float64, so its group floor is 42.6 dB, not fp16's 48.2.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from ..numerics.formats import format_of, ulp as ulp_of
from ..numerics.metrics import sqnr_db
from .limits import DB_PER_BIT, FIRST_STEP_MARGIN_DB
from .configs import TrainConfig
from .drift import Drift, drift_between
from .float64 import ExactStep
from .trajectory import Trajectory

__all__ = ["TrainMetrics", "compare_trajectories", "tensors_sqnr_db", "underflow_rates", "update_lost_rates",
           "significant", "mantissa_eps", "NOISE_FLOOR", "GradientLoss", "resolvable_db", "group_floors", "unresolved_reason"]

# below this fraction of a tensor's largest exact value an element is rounding noise: the sum that
# gave it cancels (float64 leaves about 1e-16 of the terms' size, fp32 1e-8; 2^-24 sits between)
NOISE_FLOOR = 2.0 ** -24
FP32_BITS = 23  # float32's mantissa bits, as format_of counts them


def tensors_sqnr_db(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], names=None) -> float:
    """The SQNR of the named tensors together (metrics.sqnr_db); -inf when ``out`` holds a
    non-finite value, NaN when the two share no name."""
    names = [n for n in (ref if names is None else names) if n in ref and n in out]
    if not names:
        return float("nan")
    r = torch.cat([ref[n].flatten().double() for n in names])
    o = torch.cat([out[n].flatten().double() for n in names])
    if not bool(torch.isfinite(o).all()):
        return float("-inf")
    return sqnr_db(float(torch.linalg.vector_norm(r)), float(torch.linalg.vector_norm(o - r)))


def significant(exact: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """Elements of ``exact`` above ``threshold`` and above the rounding noise of the tensor
    (``NOISE_FLOOR`` x its largest magnitude)."""
    a = exact.double().abs()
    top = float(a.max()) if a.numel() else 0.0
    return (a > NOISE_FLOOR * top) & (a >= threshold) & (a > 0)


@dataclass
class GradientLoss:
    """Per parameter, the gradients 0 in a run: ``rate`` over the significant elements within the
    format's range (the verdict), ``below_range`` over the significant elements below it (shown)."""

    rate: dict[str, float] = field(default_factory=dict)
    below_range: dict[str, float] = field(default_factory=dict)
    elements: dict[str, int] = field(default_factory=dict)  # the significant elements ``rate`` counts over
    below_elements: dict[str, int] = field(default_factory=dict)  # the significant elements ``below_range`` counts over


def underflow_rates(out: dict[str, torch.Tensor], exact: dict[str, torch.Tensor], threshold: float = 0.0) -> GradientLoss:
    """Per parameter of ``exact``: the fraction of its significant elements at or above
    ``threshold`` that are 0 in ``out`` (1.0 where no gradient reached it in ``out``), and the same
    fraction below ``threshold``; parameters with no such element are left out of each."""
    loss = GradientLoss()
    for n, g_ref in exact.items():
        g = out.get(n)
        sig = significant(g_ref)
        in_range = sig & (g_ref.double().abs() >= threshold)
        for mask, rates in ((in_range, loss.rate), (sig & ~in_range, loss.below_range)):
            total = int(mask.sum())
            if total:
                rates[n] = 1.0 if g is None else int(((g == 0) & mask).sum()) / total
                (loss.elements if rates is loss.rate else loss.below_elements)[n] = total
    return loss


def update_lost_rates(changed: dict[str, torch.Tensor], exact: ExactStep) -> tuple[dict[str, float], dict[str, int]]:
    """Per parameter: of the elements whose exact first update fp32 weights keep (more than half an
    fp32 ULP of the weight, and above the tensor's rounding noise), the fraction ``changed`` says
    never moved in the run; and how many such elements each has."""
    lost, elements = {}, {}
    for n, delta in exact.update.items():
        ulp = ulp_of(exact.initial[n].float(), torch.float32)
        keep = significant(delta) & (delta.abs() > ulp / 2)
        total = int(keep.sum())
        if total and n in changed:
            lost[n] = int((~changed[n] & keep).sum()) / total
            elements[n] = total
    return lost, elements


@dataclass
class TrainMetrics:
    """One config's run against the fp32 run from the same seed and the float64 first step (all
    plain values)."""

    steps: int
    loss_deviation: list[float | None]  # |loss - fp32 loss| / |fp32 loss| per step
    max_loss_deviation: float
    grad_sqnr_db: float  # all gradients at the first step the optimizer ran
    group_grad_sqnr_db: dict[str, float]  # per parameter group, at that step
    worst_grad_sqnr_db: float  # the lowest per-group gradient SQNR over the steps
    worst_grad_sqnr_at: tuple[int, str] | None  # (step, group) where it was
    grad_norm_ratio: list[float | None]  # |grad| / |fp32 grad| per step
    worst_grad_norm_ratio: float | None  # the ratio farthest from 1 (by its log)
    grad_cosine: float  # cosine of all gradients with fp32's at the first step
    param_sqnr_db: float  # final parameters
    update_sqnr_db: float  # final minus initial parameters, against fp32's
    underflow_rate: dict[str, float]  # per parameter: significant exact grads in range, 0 here (first step)
    below_range_underflow: dict[str, float]  # per parameter: the same below the format's range (shown)
    update_lost_rate: dict[str, float]  # per parameter: exact first updates fp32 keeps, never moved here
    update_ratio: float | None  # median over steps of |update| / |fp32 update|
    skipped: list[int]
    scales: list[float | None]
    scales_used: list[float | None]
    first_nonfinite: tuple[int, str] | None
    grad_norms: list[float | None]
    fp32_grad_norms: list[float | None]
    losses: list[float]
    fp32_losses: list[float]
    step_time_s: float  # median wall time of a step, the first (warm-up) left out
    fp32_step_time_s: float
    step_time_spread: float = math.nan  # half the interquartile range of the steps' times, relative to the median
    fp32_step_time_spread: float = math.nan
    groups: dict[str, list[str]] = field(default_factory=dict)  # group label -> parameter names
    truth: str = "float64"  # what the rates were judged against
    underflow_elements: dict[str, int] = field(default_factory=dict)  # significant gradients per parameter
    update_elements: dict[str, int] = field(default_factory=dict)  # significant first updates per parameter
    below_range_elements: dict[str, int] = field(default_factory=dict)  # significant gradients below the range
    built_dtypes: dict[str, list[str]] = field(default_factory=dict)  # parameters model_fn built not in float32
    # per group at the first step, what the format can keep of it (compare.resolvable_db): the floor
    # where it is below the format's, and the groups not judged where nothing is left (the module docstring)
    group_floor_db: dict[str, float] = field(default_factory=dict)
    unresolved: dict[str, float] = field(default_factory=dict)
    grad_sqnr_by_step: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> group -> SQNR
    grad_error_in: dict[int, dict[str, str]] = field(default_factory=dict)  # step -> group -> parameter with most error
    drift: Drift | None = None  # fp32's own distance from the float64 run (training.drift)
    # the first applied update's SQNR against the float64 step's, this run's and fp32's (NaN without it)
    first_update_db: float = math.nan
    fp32_first_update_db: float = math.nan

    def worst(self, rates: dict[str, float]) -> tuple[str, float]:
        name = max(rates, key=lambda n: (rates[n], n)) if rates else None
        return (name, rates[name]) if name is not None and rates[name] > 0 else ("-", 0.0)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["first_nonfinite"] = list(self.first_nonfinite) if self.first_nonfinite else None
        d["worst_grad_sqnr_at"] = list(self.worst_grad_sqnr_at) if self.worst_grad_sqnr_at else None
        d["drift"] = dataclasses.asdict(self.drift) if self.drift is not None else None
        return d


def group_labels(groups: list[list[str]]) -> dict[str, list[str]]:
    """``{"group 0": names, ...}``; one group is ``{"all parameters": names}``."""
    if len(groups) <= 1:
        return {"all parameters": groups[0] if groups else []}
    return {f"group {i}": names for i, names in enumerate(groups)}


def _log_distance(ratio: float | None) -> float:
    if ratio is None:
        return -1.0
    if not (ratio > 0 and math.isfinite(ratio)):
        return math.inf
    return abs(math.log(ratio))


def compare_trajectories(run: Trajectory, ref: Trajectory, config: TrainConfig | None = None,
                         exact: ExactStep | None = None, truth: str = "float64",
                         float64: Trajectory | None = None) -> TrainMetrics:
    """``run`` against the fp32 run ``ref``; the rates against ``exact`` (the float64 first step;
    without it, against the fp32 run's gradients at that step, as ``truth`` should then say); with
    ``float64``, the spec's whole run in float64, how far fp32 itself drifted from it (``drift``)."""
    dev = []
    for a, b in zip(run.losses, ref.losses):
        dev.append(abs(a - b) / abs(b) if math.isfinite(a) and b != 0 else (0.0 if a == b else math.inf))
    first = run.first_step
    ref_grads = ref.grads.get(first, {}) if first is not None else {}
    groups = group_labels(ref.groups or [list(ref.initial)])

    floors, noise = (group_floors(groups, ref_grads, exact.grads, config.mantissa_bits)
                     if exact is not None and first is not None and config is not None and ref_grads else ({}, {}))
    group_sqnr = {g: tensors_sqnr_db(run.grads0, ref_grads, names) for g, names in groups.items()
                  if g not in noise} if ref_grads else {}
    worst, worst_at = math.nan, None
    by_step: dict[int, dict[str, float]] = {}
    error_in: dict[int, dict[str, str]] = {}
    ratios: list[float | None] = []
    for i in range(len(run.losses)):
        a, b = run.grads.get(i), ref.grads.get(i)
        if a is None or b is None:
            ratios.append(None)
            continue
        na, nb = run.grad_norms[i], ref.grad_norms[i]
        ratios.append(na / nb if nb else (1.0 if na == 0 else math.inf))
        for g, names in groups.items():
            if g in noise and i == first:
                continue
            s, top = _group_error(a, b, names)
            by_step.setdefault(i, {})[g] = s
            if top is not None:
                error_in.setdefault(i, {})[g] = top
            if g not in noise and (worst_at is None or s < worst):  # noise at the first step is noise later
                worst, worst_at = s, (i, g)
    worst_ratio = max((r for r in ratios if r is not None), key=_log_distance, default=None)

    scale = config.underflow_scale(run.scales_used[first] if first is not None and first < len(run.scales_used)
                                   else None) if config is not None else 1.0
    threshold = 0.0
    if config is not None and not config.fp8:  # fp8's per-tensor scaling makes its range relative
        threshold = format_of(config.compute_dtype).smallest_normal / scale
    if exact is not None and first is not None:
        loss = underflow_rates(run.grads0, exact.grads, threshold)
        lost, lost_elements = update_lost_rates(run.changed, exact)
    else:  # no float64 step: against what the fp32 run has and moved
        loss = underflow_rates(run.grads0, ref_grads, threshold) if ref_grads else GradientLoss()
        lost, lost_elements = {}, {}
        for n, moved32 in ref.changed.items():
            total = int(moved32.sum())
            if total:
                lost[n] = int((~run.changed[n] & moved32).sum()) / total
                lost_elements[n] = total

    update_norms = [a / b for a, b in zip(run.update_norms, ref.update_norms) if a is not None and b]
    ratio = float(torch.tensor(update_norms).median()) if update_norms else None
    finite = [d for d in dev if d is not None]
    moved = {n: run.final[n].double() - run.initial[n].double() for n in run.final}
    moved32 = {n: ref.final[n].double() - ref.initial[n].double() for n in ref.final}
    return TrainMetrics(
        steps=len(run.losses), loss_deviation=dev, max_loss_deviation=max(finite) if finite else 0.0,
        grad_sqnr_db=tensors_sqnr_db(run.grads0, ref_grads), group_grad_sqnr_db=group_sqnr,
        worst_grad_sqnr_db=worst, worst_grad_sqnr_at=worst_at,
        grad_norm_ratio=ratios, worst_grad_norm_ratio=worst_ratio, grad_cosine=_cosine(run.grads0, ref_grads),
        param_sqnr_db=tensors_sqnr_db(run.final, ref.final), update_sqnr_db=tensors_sqnr_db(moved, moved32),
        underflow_rate=loss.rate, below_range_underflow=loss.below_range, update_lost_rate=lost,
        update_ratio=ratio, skipped=run.skipped, scales=run.scales, scales_used=run.scales_used,
        first_nonfinite=run.first_nonfinite, grad_norms=run.grad_norms, fp32_grad_norms=ref.grad_norms,
        losses=run.losses, fp32_losses=ref.losses, step_time_s=_median_step(run), fp32_step_time_s=_median_step(ref),
        step_time_spread=step_spread(run), fp32_step_time_spread=step_spread(ref),
        groups=groups, truth=truth if exact is not None or first is None else "the fp32 run (no float64 step)",
        underflow_elements=loss.elements, update_elements=lost_elements, below_range_elements=loss.below_elements,
        built_dtypes=dict(run.built_dtypes), unresolved=noise, grad_sqnr_by_step=by_step, grad_error_in=error_in,
        drift=drift_between(ref, float64, groups, tensors_sqnr_db) if float64 is not None else None, group_floor_db=floors,
        first_update_db=_first_update_db(run, exact), fp32_first_update_db=_first_update_db(ref, exact))


def _group_error(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], names: list[str]) -> tuple[float, str | None]:
    """The SQNR of the named tensors together (``tensors_sqnr_db``'s), and the parameter whose gradient
    differs most from ``ref``'s (by the norm of the difference: where the group's error is; None where
    nothing differs or ``out`` is not finite), from one pass over the differences."""
    names = [n for n in names if n in ref and n in out]
    if not names:
        return float("nan"), None
    if not all(bool(torch.isfinite(out[n]).all()) for n in names):
        return float("-inf"), None
    errors = {n: float(torch.linalg.vector_norm(out[n].double() - ref[n].double())) for n in names}
    signal = math.sqrt(sum(float(torch.linalg.vector_norm(ref[n].double())) ** 2 for n in names))
    top = max(errors, key=lambda n: (errors[n], n))
    return sqnr_db(signal, math.sqrt(sum(e * e for e in errors.values()))), (top if errors[top] > 0 else None)


def _first_update_db(t: Trajectory, exact: ExactStep | None) -> float:
    """The SQNR of ``t``'s first applied update against the float64 step's (NaN where either is missing)."""
    if exact is None or not t.after_first or t.first_step != exact.step:
        return math.nan
    moved = {n: t.after_first[n].double() - t.initial[n].double() for n in t.after_first}
    return tensors_sqnr_db(moved, exact.update)


def group_floors(groups: dict[str, list[str]], fp32: dict[str, torch.Tensor], exact: dict[str, torch.Tensor] | None,
                 bits: int) -> tuple[dict[str, float], dict[str, float]]:
    """The first-step floor each group's own conditioning gives (``resolvable_db`` less the margin),
    and the groups with nothing left to judge, with what the format can keep of them (the module
    docstring); none without the float64 gradients."""
    if exact is None:
        return {}, {}
    resolvable = resolvable_db(groups, fp32, exact, bits)
    noise = {g: db for g, db in resolvable.items() if not db - FIRST_STEP_MARGIN_DB > 0}
    return {g: db - FIRST_STEP_MARGIN_DB for g, db in resolvable.items() if g not in noise}, noise


def unresolved_reason(precision: str) -> str:
    """Why a group ``group_floors`` left unresolved is not judged, in a sentence."""
    return (f"what {precision} can keep of them, fp32's SQNR against the float64 step less 6.02 dB per mantissa bit "
            "it lacks, is nothing (a group whose exact gradient is 0 or tiny beside the terms it sums, as a residual "
            "scalar beside zero-initialised blocks); every run holds noise there")


def resolvable_db(groups: dict[str, list[str]], fp32: dict[str, torch.Tensor], exact: dict[str, torch.Tensor],
                  bits: int) -> dict[str, float]:
    """Per group, what a format of ``bits`` mantissa bits can keep of its first-step gradient: fp32's
    SQNR against the float64 one less 6.02 dB per bit fp32 has beyond ``bits``."""
    out = {}
    for g, names in groups.items():
        db = tensors_sqnr_db(fp32, exact, names)
        if not math.isnan(db):
            out[g] = db - DB_PER_BIT * (FP32_BITS - bits)
    return out


def _cosine(out: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    names = [n for n in ref if n in out]
    if not names:
        return math.nan
    o = torch.cat([out[n].flatten().double() for n in names])
    r = torch.cat([ref[n].flatten().double() for n in names])
    denom = float(torch.linalg.vector_norm(o) * torch.linalg.vector_norm(r))
    return float(o @ r) / denom if denom > 0 and math.isfinite(denom) else math.nan


def _median_step(t: Trajectory) -> float:
    times = t.step_times[1:] or t.step_times
    return float(torch.tensor(times).median()) if times else math.nan


def step_spread(t: Trajectory) -> float:
    """How much a step's time moves between steps: half the interquartile range over the median
    (the first, warm-up step left out); NaN with fewer than 4 steps to tell."""
    times = t.step_times[1:]
    if len(times) < 4:
        return math.nan
    q1, q2, q3 = torch.tensor(times, dtype=torch.float64).quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return float((q3 - q1) / 2 / q2) if q2 > 0 else math.nan


def speedup_text(step: float | None, spread: float | None, fp32_step: float | None, fp32_spread: float | None) -> str:
    """fp32's step time over this one's, where the difference is clear of the steps' spread:
    "1.31 x"; "noise" where it is within twice their combined spread (a CPU runner's steps move
    tens of percent between runs), "-" where there is nothing to compare."""
    if not (step and fp32_step and math.isfinite(step) and math.isfinite(fp32_step) and step > 0 and fp32_step > 0):
        return "-"
    ratio = fp32_step / step
    spreads = [s for s in (spread, fp32_spread) if s is not None]
    if len(spreads) < 2 or not all(math.isfinite(s) for s in spreads):
        return "noise"
    if abs(math.log(ratio)) <= 2 * math.hypot(*spreads):
        return "noise"
    return f"{ratio:.2f} x"


def mantissa_eps(dtype: torch.dtype) -> float:
    return format_of(dtype).eps

"""Error budgets: how much error a result may have, and the check against one.

Two budgets, both reported: the *peer* budget scales the error of a trusted implementation run
in the same config (k x its max error plus a floor), the *regression* budget scales the error
recorded when the golden was accepted. Overflow, underflow and NaN counts may not exceed the
peer's or the accepted counts.

A regression budget limits the largest error and the typical one: the mean ULP (outputs judged
in ULPs) or the RMS error (outputs judged on absolute error). The largest error moves with the
summation order, the typical one far less, and a systematic loss of precision (a sum kept in
fp16) moves both: the mean's budget can be tight where the maximum's cannot. Neither is ever
held below what a correct implementation can have under another summation order: a floor the
kind derives from the problem (attention's conditioning of exp), and, for the typical error,
half the typical error of the same-precision peer in the same run.

Measured on one AVX512 machine simulating others (ATen ISA avx512/avx2/default, OpenBLAS
kernels SkylakeX/Haswell/Sandybridge, numpy SIMD levels, 1 or 2 threads), over every built-in
case: the maximum moved up to 3.0 x and the typical error up to 2.2 x between machines (the
interpreted flash attention in fp32 at q scale 40), and 1.8 x for the RMS of torch's CPU flash
backend's dq in fp16 at q scale 40; each stays within these budgets, recorded on any one
variant and checked on every other.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from .formats import format_of
from .metrics import Comparison

__all__ = ["Budget", "abs_floor", "sum_chain", "PEER_FACTOR", "GRAD_PEER_FACTOR", "REGRESSION_SLACK", "ULP_FLOOR", "MEAN_ULP_FLOOR", "PEER_TYPICAL_FLOOR",
           "MACHINE_SPREAD", "peer_budget", "regression_budget", "violations"]

PEER_FACTOR = 2.0  # FlashAttention's forward rule: error <= 2 x the same-precision peer's
GRAD_PEER_FACTOR = 3.0  # and its rule for gradients, which sum more rounded terms than the forward
REGRESSION_SLACK = 1.5
ULP_FLOOR = 2.0  # a few ULPs of the config's dtype: rounding of the stored float32 reference included
MEAN_ULP_FLOOR = 0.25  # the mean's share of the same: a quarter ULP
PEER_TYPICAL_FLOOR = 0.5  # the typical error's budget is never below half the peer's in the same run
# How far a correct op's error moved between machines (vector ISA, BLAS kernel, threads; measured
# over every built-in case on ten simulated CPUs): largest error up to 3.0 x, typical up to 2.2 x.
# A budget borrowed from another machine grows by at least this over its 1.5 x slack: the peer's
# own move tracks it only where the peer sums in the target's order (torch's fused CPU softmax on
# rows of 32768 goes from 94 ULP on AVX512 to 152 on AVX2 while its exp/sum composite peer barely moves).
MACHINE_SPREAD = {"largest": 3.0 / REGRESSION_SLACK, "typical": 2.2 / REGRESSION_SLACK}

COUNTS = ("overflow", "underflow", "nan", "missing_nan")


@dataclass(frozen=True)
class Budget:
    """Limits on one output; a limit of None is not limited. Elementwise ULPs suit softmax
    (``max_ulp``, ``mean_ulp``); attention outputs mix values of both signs, and near-zero results
    make ULPs meaningless there, so its budgets (like FlashAttention's tests) are on absolute error
    (``max_abs``, ``rms_abs``)."""

    max_ulp: float | None
    overflow: int = 0
    underflow: int = 0
    nan: int = 0
    missing_nan: int = 0
    max_abs: float | None = None
    mean_ulp: float | None = None
    rms_abs: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Budget":
        return cls(**{k: d[k] for k in ("max_ulp", *COUNTS)}, max_abs=d.get("max_abs"), mean_ulp=d.get("mean_ulp"),
                   rms_abs=d.get("rms_abs"))

    def describe(self) -> str:
        parts = []
        for key, word in (("max_ulp", "max ULP"), ("mean_ulp", "mean ULP"), ("max_abs", "max abs"), ("rms_abs", "RMS abs")):
            value = getattr(self, key)
            if value is not None:
                parts.append(f"{word} {value:.4g}")
        return ", ".join(parts)

    @classmethod
    def widest(cls, budgets: "list[Budget]") -> "Budget":
        """Each limit at its loosest across ``budgets`` (None, not limited, is loosest; a NaN limit,
        from a golden accepted before nothing-measured read as NaN, counts as None, in any order)."""
        def loosest(values):
            return None if any(v is None or math.isnan(v) for v in values) else max(values)
        return cls(loosest([b.max_ulp for b in budgets]), *(max(getattr(b, k) for b in budgets) for k in COUNTS),
                   max_abs=loosest([b.max_abs for b in budgets]), mean_ulp=loosest([b.mean_ulp for b in budgets]),
                   rms_abs=loosest([b.rms_abs for b in budgets]))

    def scaled(self, largest: float, typical: float) -> "Budget":
        """The error limits multiplied (a budget carried to a machine whose peer errs more)."""
        def times(v, f):
            return None if v is None else v * f
        return replace(self, max_ulp=times(self.max_ulp, largest), max_abs=times(self.max_abs, largest),
                       mean_ulp=times(self.mean_ulp, typical), rms_abs=times(self.rms_abs, typical))

    def at_least_spread(self, spread: Comparison | None) -> "Budget":
        """Each error limit raised, where below it, to what a second call on the same inputs moved
        (``spread``: its comparison with the first call) plus the floor: a nondeterministic target's
        budget never sits below its own run-to-run spread."""
        if spread is None:
            return self

        def at_least(v, moved, floor=0.0):
            return None if v is None or math.isnan(moved) else max(v, moved + floor)
        return replace(self, max_ulp=at_least(self.max_ulp, spread.max_ulp, ULP_FLOOR),
                       mean_ulp=at_least(self.mean_ulp, spread.mean_ulp, MEAN_ULP_FLOOR),
                       max_abs=at_least(self.max_abs, spread.max_abs), rms_abs=at_least(self.rms_abs, spread.rms_abs))

    def with_typical_floor(self, peer: Comparison, fraction: float = PEER_TYPICAL_FLOOR) -> "Budget":
        """The typical-error limit raised to ``fraction`` of the peer's typical error, if below it."""
        def at_least(v, floor):
            return None if v is None else max(v, floor)
        return replace(self, mean_ulp=at_least(self.mean_ulp, fraction * peer.mean_ulp),
                       rms_abs=at_least(self.rms_abs, fraction * peer.rms_abs))


def _measured(value: float) -> float:
    """An accepted error, 0 where nothing was measured (NaN: no element finite on both sides), so
    the floors set the budget rather than a NaN limit that nothing can meet."""
    return 0.0 if math.isnan(value) else value


def sum_chain(n: int) -> int:
    """Longest chain of additions in a sum of n terms, which bounds its rounding error (chain x u
    x the sum of the terms' magnitudes): the whole row when short; else a quarter of it (every SIMD
    and GPU reduction keeps at least 4 partial sums) plus 20 (up to 16 leftover elements added one
    by one, and 4 levels combining the partial sums)."""
    return max(min(n - 1, math.ceil(n / 4) + 20), 0)


def abs_floor(ref_max_abs: float, dtype, ulps: float = ULP_FLOOR) -> float:
    """A floor of ``ulps`` ULPs of ``dtype`` at the reference's largest magnitude: never below
    ``ulps`` of its smallest subnormal, the spacing of every value under its smallest normal (a
    SiLU gradient at gates near -17 is all fp16 subnormals, where 2^-mantissa_bits of the largest
    value is a fraction of the spacing and rounding alone would exceed it)."""
    fmt = format_of(dtype)
    return ulps * max(ref_max_abs * 2.0 ** -fmt.mantissa_bits, fmt.smallest_subnormal)


def peer_budget(peer: Comparison, factor: float = PEER_FACTOR, floor: float = ULP_FLOOR, *,
                abs_floor_value: float | None = None, rms_floor_value: float | None = None,
                rms_factor: float | None = None, careful_rms: float = 0.0) -> Budget:
    """k x the peer's error plus a floor: on ULPs, or on max abs when ``abs_floor_value`` is given
    (and on RMS abs too when ``rms_floor_value`` is: ``rms_factor``, default k, x the larger of the
    peer's RMS error and ``careful_rms``)."""
    counts = (peer.overflow, peer.underflow, peer.nan, peer.missing_nan)
    if abs_floor_value is not None:
        rms = None if rms_floor_value is None else \
            (factor if rms_factor is None else rms_factor) * max(_measured(peer.rms_abs), careful_rms) + rms_floor_value
        return Budget(None, *counts, max_abs=factor * _measured(peer.max_abs) + abs_floor_value, rms_abs=rms)
    return Budget(factor * _measured(peer.max_ulp) + floor, *counts)


def regression_budget(accepted: Comparison, slack: float = REGRESSION_SLACK, floor: float = ULP_FLOOR, *,
                      abs_floor_value: float | None = None, reorder_max: float = 0.0,
                      reorder_rms: float = 0.0) -> Budget:
    """``slack`` x the accepted error plus a floor of a few ULPs, for the largest and the typical
    error; on absolute error when ``abs_floor_value`` (the ULP floor as an absolute error) is
    given. ``reorder_max`` and ``reorder_rms``: what the problem's conditioning lets a correct
    implementation's max and RMS error reach under another summation order; the budget never
    sits below them."""
    counts = (accepted.overflow, accepted.underflow, accepted.nan, accepted.missing_nan)
    if abs_floor_value is not None:
        return Budget(None, *counts, max_abs=max(slack * _measured(accepted.max_abs) + abs_floor_value, reorder_max),
                      rms_abs=max(slack * _measured(accepted.rms_abs), reorder_rms))
    return Budget(slack * _measured(accepted.max_ulp) + floor, *counts,
                  mean_ulp=slack * _measured(accepted.mean_ulp) + MEAN_ULP_FLOOR)


_COUNT_WORDS = {"overflow": "overflow", "underflow": "underflow", "nan": "NaN", "missing_nan": "NaN expected but missing"}


def violations(cmp: Comparison, budget: Budget) -> list[tuple[str, str]]:
    """(category, sentence) for each way ``cmp`` exceeds ``budget``; empty when within it."""
    out = []
    for k in COUNTS:
        got, allowed = getattr(cmp, k), getattr(budget, k)
        if got > allowed:
            out.append((k, f"{_COUNT_WORDS[k]} {got} > {allowed} allowed"))
    if budget.max_ulp is not None and not cmp.max_ulp <= budget.max_ulp:  # also catches NaN
        n = cmp.count_over(budget.max_ulp)
        out.append(("accuracy", f"max ULP {cmp.max_ulp:.4g} > budget {budget.max_ulp:.4g} ({n} of {cmp.numel} elements over)"))
    # the errors over elements finite on both sides are NaN when there are none: nothing measured,
    # and the counts above judge the elements lost
    for key, word in (("max_abs", "max abs"), ("mean_ulp", "mean ULP"), ("rms_abs", "RMS abs")):
        got, allowed = getattr(cmp, key), getattr(budget, key)
        if allowed is not None and not math.isnan(got) and not got <= allowed:
            out.append(("accuracy", f"{word} {got:.4g} > budget {allowed:.4g}"))
    return out

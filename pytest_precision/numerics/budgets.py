"""Error budgets: how much error a result may have, and the check against one.

Two budgets, both reported: the *peer* budget scales the error of a trusted implementation run
in the same config (k x its max ULP plus a floor), the *regression* budget scales the error
recorded when the golden was accepted (slack x that plus a floor). Overflow, underflow and NaN
counts may not exceed the peer's or the accepted counts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .metrics import Comparison

__all__ = ["Budget", "abs_floor", "PEER_FACTOR", "REGRESSION_SLACK", "ULP_FLOOR", "peer_budget", "regression_budget", "violations"]

PEER_FACTOR = 2.0  # FlashAttention's forward rule: error <= 2 x the same-precision peer's
REGRESSION_SLACK = 1.5
ULP_FLOOR = 2.0  # a few ULPs of the config's dtype: rounding of the stored float32 reference included

COUNTS = ("overflow", "underflow", "nan", "missing_nan")


@dataclass(frozen=True)
class Budget:
    """Limits on one output. ``max_ulp`` or ``max_abs`` may be None (not limited): elementwise
    ULPs suit softmax; attention outputs mix values of both signs, and near-zero results make
    ULPs meaningless there, so its budgets (like FlashAttention's tests) are on max abs error."""

    max_ulp: float | None
    overflow: int = 0
    underflow: int = 0
    nan: int = 0
    missing_nan: int = 0
    max_abs: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Budget":
        return cls(**{k: d[k] for k in ("max_ulp", *COUNTS)}, max_abs=d.get("max_abs"))

    def describe(self) -> str:
        parts = []
        if self.max_ulp is not None:
            parts.append(f"max ULP {self.max_ulp:.4g}")
        if self.max_abs is not None:
            parts.append(f"max abs {self.max_abs:.4g}")
        return ", ".join(parts)

    @classmethod
    def widest(cls, budgets: "list[Budget]") -> "Budget":
        """Each limit at its loosest across ``budgets`` (None, not limited, is loosest)."""
        def loosest(values):
            return None if any(v is None for v in values) else max(values)
        return cls(loosest([b.max_ulp for b in budgets]), *(max(getattr(b, k) for b in budgets) for k in COUNTS),
                   max_abs=loosest([b.max_abs for b in budgets]))


def abs_floor(ref_max_abs: float, dtype_mantissa_bits: int, ulps: float = ULP_FLOOR) -> float:
    """A floor of ``ulps`` ULPs of the dtype at the reference's largest magnitude."""
    return ulps * ref_max_abs * 2.0 ** -dtype_mantissa_bits


def peer_budget(peer: Comparison, factor: float = PEER_FACTOR, floor: float = ULP_FLOOR, *,
                abs_floor_value: float | None = None) -> Budget:
    """k x the peer's error plus a floor: on ULPs, or on max abs when ``abs_floor_value`` is given."""
    counts = (peer.overflow, peer.underflow, peer.nan, peer.missing_nan)
    if abs_floor_value is not None:
        return Budget(None, *counts, max_abs=factor * peer.max_abs + abs_floor_value)
    return Budget(factor * peer.max_ulp + floor, *counts)


def regression_budget(accepted: Comparison, slack: float = REGRESSION_SLACK, floor: float = ULP_FLOOR, *,
                      abs_floor_value: float | None = None) -> Budget:
    counts = (accepted.overflow, accepted.underflow, accepted.nan, accepted.missing_nan)
    if abs_floor_value is not None:
        return Budget(None, *counts, max_abs=slack * accepted.max_abs + abs_floor_value)
    return Budget(slack * accepted.max_ulp + floor, *counts)


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
    if budget.max_abs is not None and not cmp.max_abs <= budget.max_abs:
        out.append(("accuracy", f"max abs {cmp.max_abs:.4g} > budget {budget.max_abs:.4g}"))
    return out

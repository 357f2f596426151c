"""Error budgets (DESIGN 2.3): how much error a result may have, and the check against one.

Two budgets, both reported: the *peer* budget scales the error of a trusted implementation run
in the same config (k x its max ULP plus a floor), the *regression* budget scales the error
recorded when the golden was accepted (slack x that plus a floor). Overflow, underflow and NaN
counts may not exceed the peer's or the accepted counts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .metrics import Comparison

__all__ = ["Budget", "PEER_FACTOR", "REGRESSION_SLACK", "ULP_FLOOR", "peer_budget", "regression_budget", "violations"]

PEER_FACTOR = 2.0  # FlashAttention's forward rule: error <= 2 x the same-precision peer's
REGRESSION_SLACK = 1.5
ULP_FLOOR = 2.0  # a few ULPs of the config's dtype: rounding of the stored float32 reference included

COUNTS = ("overflow", "underflow", "nan", "missing_nan")


@dataclass(frozen=True)
class Budget:
    max_ulp: float
    overflow: int = 0
    underflow: int = 0
    nan: int = 0
    missing_nan: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Budget":
        return cls(**{k: d[k] for k in ("max_ulp", *COUNTS)})


def peer_budget(peer: Comparison, factor: float = PEER_FACTOR, floor: float = ULP_FLOOR) -> Budget:
    return Budget(factor * peer.max_ulp + floor, peer.overflow, peer.underflow, peer.nan, peer.missing_nan)


def regression_budget(accepted: Comparison, slack: float = REGRESSION_SLACK, floor: float = ULP_FLOOR) -> Budget:
    return Budget(slack * accepted.max_ulp + floor, accepted.overflow, accepted.underflow, accepted.nan,
                  accepted.missing_nan)


_COUNT_WORDS = {"overflow": "overflow", "underflow": "underflow", "nan": "NaN", "missing_nan": "NaN expected but missing"}


def violations(cmp: Comparison, budget: Budget) -> list[tuple[str, str]]:
    """(category, sentence) for each way ``cmp`` exceeds ``budget``; empty when within it."""
    out = []
    for k in COUNTS:
        got, allowed = getattr(cmp, k), getattr(budget, k)
        if got > allowed:
            out.append((k, f"{_COUNT_WORDS[k]} {got} > {allowed} allowed"))
    if not cmp.max_ulp <= budget.max_ulp:  # also catches NaN
        n = cmp.count_over(budget.max_ulp)
        out.append(("accuracy", f"max ULP {cmp.max_ulp:.4g} > budget {budget.max_ulp:.4g} ({n} of {cmp.numel} elements over)"))
    return out

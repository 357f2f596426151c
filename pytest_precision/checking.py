"""One case, judged three ways (issue 2, DESIGN 2.3): against the float64 oracle with the peer
budget, against the golden with the regression budget, and by its overflow / underflow / NaN
counts. Builds the verdict, the summary record and the pytest-regressions-style message."""
from __future__ import annotations

from dataclasses import dataclass, field

from .budgets import Budget, violations
from .faults import Fault
from .golden import GoldenResult
from .metrics import Comparison

__all__ = ["CaseOutcome", "PrecisionFailure", "judge"]

# headline order: the most specific cause first
_CATEGORY_ORDER = ("overflow", "underflow", "nan", "missing_nan", "accuracy", "regression", "baseline")


class PrecisionFailure(AssertionError):
    """A precision verdict that failed; its message is the full report."""


@dataclass
class CaseOutcome:
    suite: str
    target: str
    config: str
    regime: str
    oracle: Comparison
    peer: Comparison | None
    peer_budget: Budget | None
    golden: GoldenResult
    fault: Fault | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (check, category, sentence)

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def categories(self) -> list[str]:
        cats = {c for _, c, _ in self.problems}
        if self.fault is not None and self.fault.kind in ("overflow", "underflow") and cats & {"nan", "accuracy"}:
            cats.add(self.fault.kind)  # NaN at the output that began as an overflow is an overflow
        return [c for c in _CATEGORY_ORDER if c in cats]

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL " + ",".join(self.categories)

    def record(self) -> dict:
        """The summary row of this case (plain types: it crosses to the xdist controller)."""
        o = self.oracle
        return {
            "suite": self.suite, "target": self.target, "config": self.config, "regime": self.regime,
            "max_ulp": o.max_ulp, "max_rel": o.max_rel, "sqnr_db": o.sqnr_db,
            "overflow": o.overflow, "underflow": o.underflow, "nan": o.nan,
            "passed": self.passed, "categories": self.categories,
            "baseline_update": self.golden.updated,
        }

    def message(self, nodeid: str, update_command: str) -> str:
        o = self.oracle
        lines = [f"{nodeid}: {self.verdict} ({', '.join(s for _, _, s in self.problems)})"]
        if self.fault is not None:
            lines.append(f"  {self.fault.describe()} under {self.config}")
        lines.append(f"  shape {o.shape}, ULPs in {o.dtype}")
        lines.append("  against the float64 oracle on the rounded inputs:")
        lines += [f"    {s}" for s in o.statistics_lines()]
        if self.peer is not None and self.peer_budget is not None:
            pb = self.peer_budget
            lines.append(f"    peer (torch's op, same config): max ULP {self.peer.max_ulp:.4g} -> budget {pb.max_ulp:.4g};"
                         f" peer overflow {pb.overflow}, underflow {pb.underflow}, NaN {pb.nan}")
            over = o.count_over(pb.max_ulp)
            lines.append(f"    {over} of {o.numel} elements over the peer budget")
        if o.worst:
            lines.append("    worst elements:")
            lines += ["      " + row for row in o.worst_table().splitlines()]
        g = self.golden
        if g.error:
            lines.append("  golden baseline:")
            lines += ["    " + s for s in g.error.splitlines()]
        else:
            for name, gc in g.comparisons.items():
                b = g.budgets[name]
                label = "" if len(g.comparisons) == 1 else f"{name} "
                lines.append(f"  {label}against the golden (regression budget {b.describe()}):")
                over = f", {gc.count_over(b.max_ulp)} of {gc.numel} elements over" if b.max_ulp is not None else ""
                lines.append(f"    max ULP {gc.max_ulp:.4g}, max abs {gc.max_abs:.4g}{over};"
                             f" overflow {gc.overflow}, underflow {gc.underflow}, NaN {gc.nan}")
        if not g.error:
            lines.append(f"  if the new results are intended, accept them as the golden with: {update_command}")
            if any(check == "oracle" for check, _, _ in self.problems):
                lines.append("  (the oracle check compares with torch's op in the same config and fails until the target"
                             " is fixed)")
        return "\n".join(lines)


def judge(
    *, suite: str, target: str, config: str, regime: str,
    oracle: Comparison, peer: Comparison | None, peer_budget: Budget | None,
    golden: GoldenResult, fault: Fault | None = None,
) -> CaseOutcome:
    problems: list[tuple[str, str, str]] = []
    if peer_budget is not None:
        for cat, s in violations(oracle, peer_budget):
            problems.append(("oracle", cat, f"oracle: {s}"))
    if golden.error:
        problems.append(("golden", "baseline", golden.error.splitlines()[0]))
    for cat, s in golden.problems:
        problems.append(("golden", "regression" if cat == "accuracy" else cat, f"golden: {s}"))
    return CaseOutcome(suite, target, config, regime, oracle, peer, peer_budget, golden, fault, problems)

"""One case, judged three ways (DESIGN 2.3): against the float64 oracle with the peer budget,
against the golden with the regression budget, and by its overflow / underflow / NaN counts.
Builds the verdict, the summary record and the pytest-regressions-style message.

A case may have several named outputs (attention: ``out``, ``dq``, ``dk``, ``dv``); the first is
the forward output the summary table shows, and counts are added over all of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .budgets import Budget, violations
from .faults import Fault
from .golden import GoldenResult
from .metrics import Comparison

__all__ = ["CaseOutcome", "PrecisionFailure", "judge"]

# headline order: the most specific cause first
_CATEGORY_ORDER = ("overflow", "underflow", "nan", "missing_nan", "accuracy", "regression", "baseline", "hypothesis", "speed", "memory")


class PrecisionFailure(AssertionError):
    """A precision verdict that failed; its message is the full report."""


@dataclass
class CaseOutcome:
    suite: str
    target: str
    config: str
    regime: str
    oracle: dict[str, Comparison]
    peer: dict[str, Comparison]
    peer_budget: dict[str, Budget]
    golden: GoldenResult
    peer_name: str = "torch's op"
    fault: Fault | None = None
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (check, category, sentence)
    details: list[str] = field(default_factory=list)  # lines after the verdict (a shrunk input)

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def forward(self) -> Comparison:
        return next(iter(self.oracle.values()))

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
        o = self.forward
        every = self.oracle.values()
        return {
            "suite": self.suite, "target": self.target, "config": self.config, "regime": self.regime,
            "max_ulp": o.max_ulp, "max_rel": o.max_rel, "sqnr_db": o.sqnr_db,
            "overflow": sum(c.overflow for c in every), "underflow": sum(c.underflow for c in every),
            "nan": sum(c.nan for c in every),
            "passed": self.passed, "categories": self.categories,
            "baseline_update": self.golden.updated,
            "borrowed_budget": self.golden.note is not None,
        }

    def message(self, nodeid: str, update_command: str) -> str:
        lines = [f"{nodeid}: {self.verdict} ({', '.join(s for _, _, s in self.problems)})"]
        if self.fault is not None:
            lines.append(f"  {self.fault.describe(self.config)}")
        lines += ["  " + line for line in self.details]
        several = len(self.oracle) > 1
        for name, o in self.oracle.items():
            label = f"{name}: " if several else ""
            lines.append(f"  {label}shape {o.shape}, ULPs in {o.dtype}; against the float64 oracle on the rounded inputs:")
            lines += [f"    {s}" for s in o.statistics_lines()]
            peer, pb = self.peer.get(name), self.peer_budget.get(name)
            if peer is not None and pb is not None:
                lines.append(f"    peer ({self.peer_name}, same config): max ULP {peer.max_ulp:.4g}, max abs "
                             f"{peer.max_abs:.4g} -> budget {pb.describe()}; peer overflow {pb.overflow}, "
                             f"underflow {pb.underflow}, NaN {pb.nan}")
                if pb.max_ulp is not None:
                    lines.append(f"    {o.count_over(pb.max_ulp)} of {o.numel} elements over the peer budget")
            if o.worst and (not several or any(c == "oracle" and s.startswith(f"oracle: {name}:")
                                               for c, _, s in self.problems)):
                lines.append("    worst elements:")
                lines += ["      " + row for row in o.worst_table().splitlines()]
        g = self.golden
        if g.absent:
            lines.append(f"  no golden baseline: {g.absent}")
        elif g.error:
            lines.append("  golden baseline:")
            lines += ["    " + s for s in g.error.splitlines()]
        else:
            for name, gc in g.comparisons.items():
                b = g.budgets[name]
                label = f"{name} " if several else ""
                lines.append(f"  {label}against the golden (regression budget {b.describe()}):")
                over = f", {gc.count_over(b.max_ulp)} of {gc.numel} elements over" if b.max_ulp is not None else ""
                lines.append(f"    max ULP {gc.max_ulp:.4g}, max abs {gc.max_abs:.4g}{over};"
                             f" overflow {gc.overflow}, underflow {gc.underflow}, NaN {gc.nan}")
            if g.note:
                lines.append(f"    ({g.note})")
            lines.append(f"  if the new results are intended, accept them as the golden with: {update_command}")
            if any(check == "oracle" for check, _, _ in self.problems):
                lines.append(f"  (the oracle check compares with {self.peer_name} in the same config and fails until"
                             " the target is fixed)")
        return "\n".join(lines)


def judge(*, suite: str, target: str, config: str, regime: str, oracle: dict[str, Comparison],
          peer: dict[str, Comparison], peer_budget: dict[str, Budget], golden: GoldenResult,
          peer_name: str = "torch's op") -> CaseOutcome:
    problems: list[tuple[str, str, str]] = []
    several = len(oracle) > 1
    for name, cmp in oracle.items():
        if name in peer_budget:
            label = f"{name}: " if several else ""
            for cat, s in violations(cmp, peer_budget[name]):
                problems.append(("oracle", cat, f"oracle: {label}{s}"))
    if golden.error:
        problems.append(("golden", "baseline", golden.error.splitlines()[0]))
    for cat, s in golden.problems:
        problems.append(("golden", "regression" if cat == "accuracy" else cat, f"golden: {s}"))
    return CaseOutcome(suite, target, config, regime, oracle, peer, peer_budget, golden, peer_name, None, problems)

"""The outcome of one suite case, whatever its kind: the problems found, in one category order,
one headline, one failure message.

A kind measures a case and returns an :class:`Outcome` holding its *evidence* (what it measured:
output comparisons for tensor kinds, trajectories for training), the baseline check's result,
and the problems: each a :class:`Problem` (which check found it, its category, one sentence).
The message is assembled here, once: the headline, the first fault, the kind's evidence, then
the golden baseline's part.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..baselines.entry import BaselineResult
from ..explain.faults import Fault
from ..numerics.problem import CATEGORY_ORDER, Problem
from .declarations import Declaration
from .record import CaseRecord

__all__ = ["CATEGORY_ORDER", "Problem", "Evidence", "Outcome", "PrecisionFailure", "baseline_problems",
           "declaration_fields"]

class PrecisionFailure(AssertionError):
    """A precision verdict that failed; its message is the full report."""


def declaration_fields(problems: list[Problem]) -> dict:
    """The record's fields about declarations: ``declare``, those the problems name (as plain lists),
    and ``explained``, whether every problem but a missing golden names one (adding them leaves at most
    the golden to write)."""
    found = [p.declaration for p in problems if p.declaration is not None]
    if not found:
        return {}
    judged = [p for p in problems if p.category != "baseline"]  # a missing golden: what a first run has
    return {"declare": [d.as_plain() for d in dict.fromkeys(found)],
            "explained": all(p.declaration is not None for p in judged)}


def baseline_problems(result: BaselineResult) -> list[Problem]:
    """The golden's problems as the outcome's: an unusable baseline is a ``baseline`` problem,
    an error past its budget a ``regression``, counts keep their category."""
    out = []
    if result.error:
        out.append(Problem("golden", "baseline", result.error.splitlines()[0]))
    for category, sentence in result.problems:
        out.append(Problem("golden", "regression" if category == "accuracy" else category, f"golden: {sentence}"))
    return out


class Evidence:
    """What a kind measured for a case. Subclasses supply the message body and the record fields."""

    peer_name: str | None = None  # the trusted implementation the oracle check compares with, if any

    def message_lines(self, outcome: "Outcome") -> list[str]:
        """The failure message's body (indented lines), between the fault and the golden's part."""
        return []

    def record_fields(self, outcome: "Outcome") -> dict:
        """Fields of the case's record, by name (kinds.record.CaseRecord; plain types: records cross
        from xdist workers)."""
        return {}

    def report_fields(self, outcome: "Outcome") -> dict:
        """What the JSON report adds for this case (plain types)."""
        return {}


@dataclass
class Outcome:
    suite: str
    kind: str
    target: str
    config: str  # with the variant: "fp32+math"
    regime: str
    evidence: Evidence
    baseline: BaselineResult
    problems: list[Problem] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # lines after the fault (a shrunk input, a shown rate)
    fault: Fault | None = None
    skipped_by: list = field(default_factory=list)  # Declarations that would skip this case
    # verdicts the case could not give, each with why: a case that passes every other is skipped
    # saying so (runner.collection), a failing one says it under its headline; never inside a pass
    not_judged: list[str] = field(default_factory=list)

    def add(self, check: str, category: str, sentence: str, declaration: Declaration | None = None) -> None:
        self.problems.append(Problem(check, category, sentence, declaration))

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def categories(self) -> list[str]:
        cats = {p.category for p in self.problems}
        if self.fault is not None and self.fault.kind in ("overflow", "underflow") and cats & {"nan", "accuracy"}:
            cats.add(self.fault.kind)  # NaN at the output that began as an overflow is an overflow
        return [c for c in CATEGORY_ORDER if c in cats] + sorted(cats - set(CATEGORY_ORDER))

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "FAIL " + ",".join(self.categories)

    def headline(self) -> str:
        """The verdict and every problem's sentence: the message's first line, the report's headline."""
        return self.verdict + (f" ({'; '.join(p.sentence for p in self.problems)})" if self.problems else "")

    def record(self) -> CaseRecord:
        """The record of this case: the verdict, the evidence's fields and the golden's."""
        b = self.baseline
        record = CaseRecord(self.target, self.config, self.regime, suite=self.suite, kind=self.kind,
                            passed=self.passed, categories=self.categories, baseline_update=b.updated,
                            baseline_refused=b.refused_line, borrowed_budget=b.note is not None,
                            borrowed_across_devices=b.borrowed_across_devices)
        record.add(**self.evidence.record_fields(self))
        record.add(**declaration_fields(self.problems))
        if self.skipped_by:
            record.skipped_by = [d.as_plain() for d in self.skipped_by]
        if b.moved_inputs:
            record.inputs_moved = True
        if b.unjudged:
            record.unjudged_limits = b.unjudged
        return record

    def report_details(self) -> dict:
        b = self.baseline
        return {"headline": self.headline(), **self.evidence.report_fields(self),
                "golden_note": b.error.splitlines()[0] if b.error else (b.absent or b.note or b.moved_inputs or b.unjudged)}

    def message(self, nodeid: str, update_command: str) -> str:
        lines = [f"{nodeid}: {self.headline()}"]
        if self.fault is not None:
            lines.append(f"  {self.fault.describe(self.config)}")
        lines += [f"  not judged: {line}" for line in self.not_judged]
        lines += ["  " + line for line in self.details]
        lines += self.evidence.message_lines(self)
        lines += self.baseline.message_lines(update_command)
        if self.evidence.peer_name and any(p.check == "oracle" for p in self.problems):
            lines.append(f"  (the oracle check compares with {self.evidence.peer_name} in the same config and fails"
                         " until the target is fixed)")
        return "\n".join(lines)

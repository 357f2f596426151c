"""The one way a message shows a comparison: every failure (a suite case against its oracle and
its golden, the ``golden`` fixture, a property helper) lays out the same block::

    <name>: shape (16, 256), ULPs in float16; against <what>:
      max ULP ..., p99 ULP ..., mean ULP ... (ULPs of float16)
      max abs ..., RMS abs ..., max rel ..., SQNR ... dB, cosine ...
      overflow ..., underflow ..., NaN ..., NaN expected but missing ..., subnormals flushed ...
      <what set each budget>
      <n> of <numel> elements over the <budget>
      worst elements:
        index  out  reference  ULP

A brief block (the golden's part of a suite case, whose oracle block already gave the statistics)
is the header without shape and unit, and one line of the figures a regression budget reads.
Its lines begin two spaces in, under the message's own first line."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .budgets import Budget
from .metrics import Comparison

__all__ = ["Held", "comparison_lines"]

INDENT = "  "


@dataclass(frozen=True)
class Held:
    """A budget a comparison is held to, as the message names it. ``source``: the line that says
    what set it (another run's error), or None; ``counted``: whether the elements of this
    comparison over its max ULP are counted (not for a budget that judges another pair, such as
    the compiled target against its eager run)."""

    budget: Budget
    name: str  # "the peer budget": what the elements are counted over
    source: str | None = None
    counted: bool = True

    @classmethod
    def peer(cls, peer_name: str, peer: Comparison, budget: Budget) -> "Held":
        """The budget scaled from the same-precision peer's error in the same config."""
        return cls(budget, "the peer budget", _set_by(f"peer ({peer_name}, same config)", peer, budget,
                                                      counts_of="peer"))

    @classmethod
    def compiled(cls, eager: Comparison, budget: Budget) -> "Held":
        """The compiled target's budget, scaled from its eager run (it judges compiled against eager)."""
        return cls(budget, "the compiled budget", _set_by("eager (the target not compiled, same config)", eager, budget,
                                                          called="compiled budget"), counted=False)

    @classmethod
    def regression(cls, budget: Budget) -> "Held":
        """The golden's regression budget (the header names it)."""
        return cls(budget, "the regression budget")

    def over(self, c: Comparison) -> int | None:
        """How many elements of ``c`` lie over the budget's max ULP (None: not counted)."""
        return c.count_over(self.budget.max_ulp) if self.counted and self.budget.max_ulp is not None else None


def _set_by(who: str, run: Comparison, budget: Budget, called: str = "budget", counts_of: str | None = None) -> str:
    """The line that says a budget comes from another run's error against the same reference,
    with the counts the budget allows (``counts_of``: whose they are) when given."""
    line = f"{who}: max ULP {run.max_ulp:.4g}, max abs {run.max_abs:.4g} -> {called} {budget.describe()}"
    if counts_of is not None:
        line += f"; {counts_of} overflow {budget.overflow}, underflow {budget.underflow}, NaN {budget.nan}"
    return line


def comparison_lines(c: Comparison, against: str | None, *, name: str | None = None, judged_on: str = "ulp",
                     held: Sequence[Held] = (), worst: bool = True, brief: bool = False) -> list[str]:
    """The block for ``c`` (module docstring).

    ``against``: what ``c`` was compared with ("the float64 oracle on the rounded inputs"), None
    when nothing needs saying; ``name``: the output's, when a case has several; ``judged_on``:
    ``"abs"`` for an output judged on absolute error (its ULPs only shown); ``held``: the budgets
    shown, each with what set it and the elements over it; ``worst``: whether the worst elements
    are listed (when there are any); ``brief``: the header without shape and unit, and one line of
    figures instead of the statistics, with the elements over counted in it."""
    if brief:
        head = "" if name is None else f"{name} "
    else:
        unit = "judged on absolute error" if judged_on == "abs" else f"ULPs in {c.dtype}"
        head = ("" if name is None else f"{name}: ") + f"shape {c.shape}, {unit}" + ("; " if against else "")
    lines = [f"{INDENT}{head}{f'against {against}' if against else ''}:"]
    body = INDENT * 2
    if brief:
        over = "".join(f", {n} of {c.numel} elements over" for h in held if (n := h.over(c)) is not None)
        return lines + [f"{body}max ULP {c.max_ulp:.4g}, max abs {c.max_abs:.4g}{over};"
                        f" overflow {c.overflow}, underflow {c.underflow}, NaN {c.nan}"]
    lines += [body + s for s in c.statistics_lines(judged_on=judged_on)]
    for h in held:
        n = h.over(c)
        lines += ([body + h.source] if h.source else []) + ([f"{body}{n} of {c.numel} elements over {h.name}"]
                                                            if n is not None else [])
    if worst and c.worst:
        lines.append(f"{body}worst elements:")
        lines += [body + INDENT + row for row in c.worst_table().splitlines()]
    return lines

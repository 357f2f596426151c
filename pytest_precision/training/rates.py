"""Per-parameter rates under a golden's budget (the gradient-underflow and update-lost rates of a
training golden, the underflow rate of a DDP golden): each judged as a count of the parameter's
elements, ``REGRESSION_SLACK`` x the accepted count plus what another summation order adds to it
(``limits.count_bound``)."""
from __future__ import annotations

import math

from ..numerics.budgets import REGRESSION_SLACK
from ..numerics.problem import Problem
from .limits import count_bound, count_text, percent, rate_budget_count

__all__ = ["Counted", "rates_budget", "with_count_slack", "rates_problem", "rates_describe"]

# per parameter: (rate, elements): the rate of its elements counted, and how many it counts over
Counted = dict[str, tuple[float, int]]


def rates_budget(accepted: Counted) -> dict[str, float]:
    """Per parameter, the rate allowed: ``REGRESSION_SLACK`` x the accepted count plus what another
    summation order adds to it (``limits.count_bound``), over the parameter's elements."""
    return {n: min(1.0, rate_budget_count(round(r * count), REGRESSION_SLACK) / max(1, count))
            for n, (r, count) in accepted.items()}


def with_count_slack(stored: dict[str, float], accepted: Counted) -> dict[str, float]:
    """The stored per-parameter rate budgets, each at least the one its accepted counts give today
    (a golden accepted under the earlier two-element floor travels too)."""
    derived = rates_budget(accepted)
    return {n: max(stored.get(n, 0.0), derived.get(n, 0.0)) for n in dict.fromkeys([*stored, *derived])}


def _allowed_count(budget: dict[str, float], name: str, elements: int) -> float:
    """The count of ``name``'s ``elements`` its budget allows (a parameter without one: what
    another summation order gives where none was lost)."""
    rate = budget.get(name)
    return count_bound(0) if rate is None else rate * elements


def rates_problem(word: str, accepted: Counted, budget: dict[str, float], category: str) -> Problem | None:
    """The golden's problem of ``category`` for the parameter furthest past its budget, counted in
    its elements; None within every budget."""
    worst = None
    for n, (rate, elements) in accepted.items():
        count, allowed = round(rate * elements), _allowed_count(budget, n, elements)
        if count > allowed + 1e-9 and (worst is None or (count - allowed) / max(1, elements) > worst[0]):
            worst = ((count - allowed) / max(1, elements), n, count, elements, allowed)
    if worst is None:
        return None
    _, n, count, elements, allowed = worst
    allowed = min(elements, math.floor(allowed + 1e-9))
    return Problem("golden", category, f"{word} {count_text(count, elements)} in {n} > budget {allowed} elements "
                                       f"({percent(allowed / max(1, elements))})")


def rates_describe(word: str, accepted: Counted, budget: dict[str, float]) -> str:
    """The rate budgets of a new golden in a phrase: the parameter with the most accepted, and a
    parameter at 0."""
    counted = [(round(r * elements), elements, n) for n, (r, elements) in accepted.items()]
    top = max(counted, default=None, key=lambda t: (t[0], t[2]))
    zero = f"{count_bound(0)} elements where none was accepted"
    if top is None or top[0] == 0:
        return f"{word} 0 accepted, budget {zero}"
    count, elements, n = top
    allowed = min(elements, math.floor(_allowed_count(budget, n, elements) + 1e-9))
    return f"{word} in {n} {count} of {elements} accepted, budget {allowed} elements ({zero})"

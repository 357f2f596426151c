"""The fresh regime: inputs, and for the built-in kinds shapes, drawn anew on every run.

The seeded regimes draw the same bits on every run (goldens hang on them) and, under ``CI``, the
drawn regime draws the same examples: a target special-cased to those inputs (right only on rows
of 256, or returning outputs memoised by an input checksum) passes them forever. The ``fresh``
regime of each tensor kind draws its inputs from a seed chosen once per session (``secrets``:
the tests seed Python's and torch's generators, which must not decide it), handed by the xdist
controller to its workers, and printed in the session's header and in every failing fresh case's
message with the option that replays it. Each kind draws its own (``Kind.fresh_regime``); the
default, the op kind's, is the target's first seeded regime called with a generator seeded from
the fresh seed. No golden is read or written for it (one file cannot follow inputs that change
every run): the oracle with the peer budget, the counts and the contract checks judge it.
"""
from __future__ import annotations

import math
import secrets
from typing import Any, Callable, Sequence

import torch

from ..baselines.entry import BaselineResult
from .cases import Case, Regime

__all__ = ["FRESH", "REPLAY_OPTION", "SEEDS", "new_seed", "parse_seed", "replay_advice", "session_seed", "Plan",
           "reseeded", "is_fresh", "fresh_regime_of", "fresh_result", "note_fresh", "crash_note"]

FRESH = "fresh"  # the regime's name (its case ids carry no seed: they stay the same from run to run)
REPLAY_OPTION = "--precision-fresh-seed"
SEEDS = 2 ** 32  # a session seed is one of these (what the header prints fits one line and one paste)


def new_seed() -> int:
    """A session seed from the operating system's randomness, which no test seeds."""
    return secrets.randbelow(SEEDS)


def parse_seed(raw: Any, where: str) -> int:
    """A seed given as text (``where`` names where it came from): ValueError unless a whole number in range."""
    try:
        seed = int(str(raw).strip())
    except ValueError:
        seed = -1
    if not 0 <= seed < SEEDS:
        raise ValueError(f"{where}={raw}: expected a whole number from 0 to {SEEDS - 1} (the seed a run printed)")
    return seed


def replay_advice(seed: int) -> str:
    return f"fresh inputs from seed {seed}: replay with {REPLAY_OPTION}={seed}"


def session_seed(case: Case) -> int:
    """The session's fresh seed (``RunState.fresh_seed``), chosen here for a state made without one."""
    if case.state.fresh_seed is None:
        case.state.fresh_seed = new_seed()
    return case.state.fresh_seed


class Plan:
    """What a kind draws before its inputs (sizes, a family of values), from a generator of its own
    seeded with the session seed: a few draws, made when the case's regime is built (cheap: the
    regime makes its inputs only when the case runs)."""

    def __init__(self, seed: int):
        self.seed = seed
        self.g = torch.Generator().manual_seed(seed)

    def regime(self, description: str, make: Callable[[torch.Generator], Any], **parameters) -> Regime:
        """The fresh regime: ``make(g)`` with ``g`` seeded from the session seed (``Regime.from_generator``),
        ``description`` and ``parameters`` saying what the plan drew."""
        return Regime.from_generator(FRESH, description, make, self.seed, parameters)

    def integer(self, low: int, high: int, avoid: Sequence[int] = ()) -> int:
        """Uniform in [low, high], never one of ``avoid`` (the fixed regimes' sizes)."""
        choices = [n for n in range(low, high + 1) if n not in avoid]
        return choices[int(torch.randint(len(choices), (), generator=self.g))]

    def length(self, low: int, high: int, avoid: Sequence[int] = ()) -> int:
        """Log-uniform in [low, high] (short rows as likely as long ones), never one of ``avoid``."""
        while True:
            u = float(torch.rand((), generator=self.g, dtype=torch.float64))
            n = int(round(math.exp(math.log(low) + u * (math.log(high) - math.log(low)))))
            if n not in avoid:
                return n

    def choice(self, options: Sequence) -> Any:
        return options[int(torch.randint(len(options), (), generator=self.g))]

    def flag(self, p: float = 0.5) -> bool:
        return bool(torch.rand((), generator=self.g, dtype=torch.float64) < p)


def reseeded(regime: Regime, seed: int) -> Regime:
    """``regime``'s inputs drawn from the fresh seed instead of its own (its shapes are its make's)."""
    return Regime(FRESH, f"{regime.description}, drawn from the fresh seed", regime.make, seed,
                  dict(regime.parameters), regime.irregular)


def is_fresh(case: Case) -> bool:
    """Whether ``case`` is its kind's fresh case."""
    fresh = getattr(case.kind, "fresh", None)
    return fresh is not None and case.regime == fresh


def fresh_regime_of(kind, case: Case) -> Regime | None:
    """The fresh regime of ``case`` when it is the kind's fresh case, else None."""
    if not is_fresh(case):
        return None
    regime = kind.fresh_regime(case.target, session_seed(case))
    if regime is None:  # regime_names lists it only where the kind draws one
        raise KeyError(f"{kind.name} draws no fresh inputs for target {case.target.name!r}")
    return regime


def fresh_result(kind, case: Case) -> BaselineResult | None:
    """The golden's part of a fresh case (there is none), or None for any other case."""
    if not is_fresh(case):
        return None
    return BaselineResult(absent="fresh inputs have no golden; the oracle and the peer judge them")


def note_fresh(kind, case: Case, regime: Regime, inputs: Any, details: list[str]) -> None:
    """First in a failing fresh case's details: the seed, how to replay it, and what was drawn."""
    if is_fresh(case):
        shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in kind.floating_inputs(inputs).items())
        details.insert(0, f"{replay_advice(session_seed(case))} ({regime.description}; {shapes})")


def crash_note(case: Case) -> str:
    """A line to end the message of a fresh case that crashed (the target raised, broke its
    contract, ran past its limit): the seed, how to replay it and what was drawn (a target that
    supports less than its kind draws, say no grouped-query heads, declares it); nothing for any
    other case."""
    if not is_fresh(case):
        return ""
    try:
        drawn = f" ({case.kind.fresh_regime(case.target, session_seed(case)).description})"
    except Exception:  # the crash may be the draw's own: its message says why
        drawn = ""
    return (f"\n  {replay_advice(session_seed(case))}{drawn}; a target that does not support all of that declares "
            f"its limits (its kind's declarations)")

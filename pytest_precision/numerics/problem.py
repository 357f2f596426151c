"""A problem a check found, in any kind (numerics being the lowest layer every check imports): which check, its category, one sentence, and the
declaration that makes it go where it is a choice of the target's. Below the kinds and the
training package, so every check (tensor, training, distributed) returns the same type, and the
outcome (``kinds.outcome``) orders them by ``CATEGORY_ORDER`` for the headline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CATEGORY_ORDER", "Problem"]

# headline order: the most specific cause first; categories a kind adds beyond these sort after them.
# ``convention`` (the output follows another convention the target can declare) and ``unsupported``
# (it raised on inputs with a feature it can declare it lacks) come with the declaration to add;
# ``dtype`` is a module that ran in another precision than the config and the declarations mean;
# ``success_rate`` a config that fails on more seeds than fp32; ``compiled`` torch.compile against eager
CATEGORY_ORDER = ("convention", "unsupported", "contract", "dtype", "degenerate", "overflow", "underflow", "nan",
                  "missing_nan", "accuracy", "success_rate", "regression", "baseline", "hypothesis", "nondeterministic",
                  "batch_variant", "compiled", "speed", "memory")


@dataclass(frozen=True)
class Problem:
    check: str  # what found it: "oracle" (against the exact result or the fp32 run), "golden", "speed", ...
    category: str  # one of CATEGORY_ORDER, or the kind's own
    sentence: str
    # what the target declares if it does this by design (a convention, an input written in place): the
    # problem is then gone, and the run's block of declarations lists it (reporting.declarations)
    declaration: Any = None  # a kinds.declarations.Declaration (the kinds sit above this module)

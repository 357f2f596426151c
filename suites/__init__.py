"""Built-in suites run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``).

Each suite module exposes ``NAME``, ``KINDS`` (the target kinds it tests), ``REGIMES`` (input
regime name -> description), ``default_targets()`` (used when no target of its kinds is
registered) and ``run_case(target, config, regime, ctx) -> CaseOutcome``.
"""
from . import softmax

SUITES = {softmax.NAME: softmax}

__all__ = ["SUITES"]

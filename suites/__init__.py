"""Built-in suites run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``).

Each suite module exposes ``NAME``, ``KINDS`` (the target kinds it tests), ``REGIMES`` (input
regime name -> regime), ``default_targets()`` (used when no target of its kinds is registered),
``variants(device)`` (config-id suffixes such as SDPA backends, ``[""]`` when none) and
``run_case(target, config, regime, device, golden, variant) -> CaseOutcome``.
"""
from . import attention, softmax

SUITES = {softmax.NAME: softmax, attention.NAME: attention}

__all__ = ["SUITES"]

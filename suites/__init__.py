"""Built-in suites run by ``pytest --precision-suite`` (installed as ``pytest_precision.suites``).

Each suite module exposes ``NAME``, ``KINDS`` (the target kinds it tests), ``REGIMES`` (input
regime name -> regime), ``default_targets()`` (used when no target of its kinds is registered),
``variants(device)`` (config-id suffixes such as SDPA backends, ``[""]`` when none) and
``run_case(target, config, regime, device, golden, variant) -> CaseOutcome``. A suite with its own
configs (training) has ``configs(session)``; the others run the session's config matrix.
"""
from . import attention, softmax, training

SUITES = {softmax.NAME: softmax, attention.NAME: attention, training.NAME: training}

__all__ = ["SUITES"]

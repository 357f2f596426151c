"""Where precision was lost: the op tracer (``tracing``), the first fault against the float64 run
(``faults``) and the autocast audit (``audit``). Public paths: ``pytest_precision.tracing``,
``pytest_precision.faults``, ``pytest_precision.audit``."""

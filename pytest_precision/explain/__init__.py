"""Where precision was lost: the op tracer (``tracing``), the first fault against the float64 run
(``faults``) and the autocast audit (``audit``)."""

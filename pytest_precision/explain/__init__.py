"""Where precision was lost:

- ``tracing``: the op tracer (every aten op a call runs, its dtypes and what its output holds);
- ``faults``: the first op that lost a value, against the same call in float64;
- ``audit``: the autocast audit (``--precision-audit``)."""

"""Public path of ``pytest_precision.explain.tracing``: the op tracer."""
from .explain.tracing import *  # noqa: F401,F403
from .explain.tracing import __all__  # noqa: F401

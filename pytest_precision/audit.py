"""Public path of ``pytest_precision.explain.audit``: the autocast audit."""
from .explain.audit import *  # noqa: F401,F403
from .explain.audit import __all__  # noqa: F401

"""Public path of ``pytest_precision.explain.faults``: the first op where precision was lost."""
from .explain.faults import *  # noqa: F401,F403
from .explain.faults import __all__  # noqa: F401

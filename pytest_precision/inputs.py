"""Public path of ``pytest_precision.numerics.inputs``: seeded inputs with the same bits on every machine."""
from .numerics.inputs import *  # noqa: F401,F403
from .numerics.inputs import __all__  # noqa: F401

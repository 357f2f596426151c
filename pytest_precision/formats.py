"""Public path of ``pytest_precision.numerics.formats``: dtype facts and ULP arithmetic."""
from .numerics.formats import *  # noqa: F401,F403
from .numerics.formats import __all__  # noqa: F401

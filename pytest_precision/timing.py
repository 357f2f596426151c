"""Public path of ``pytest_precision.speed.timing``: how long one call takes."""
from .speed.timing import *  # noqa: F401,F403
from .speed.timing import __all__  # noqa: F401

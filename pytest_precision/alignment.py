"""Public path of ``pytest_precision.speed.alignment``: the tensor-core alignment lint."""
from .speed.alignment import *  # noqa: F401,F403
from .speed.alignment import __all__  # noqa: F401

"""Public path of ``pytest_precision.training.distributed``: DDP gradient compression on the real engine."""
from .training.distributed import *  # noqa: F401,F403
from .training.distributed import __all__  # noqa: F401

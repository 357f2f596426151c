"""pytest-precision: numerical regression checks for softmax, attention and training code.

Register targets from a conftest.py::

    import pytest_precision
    pytest_precision.register("my_softmax", my_softmax, kind="softmax")

and run ``pytest --precision-suite``.
"""
from .alignment import TensorCoreAlignmentWarning, tensor_core_misalignments
from .configs import CONFIGS, Config
from .formats import FORMATS, format_of, ulp, ulp_distance
from .metrics import Comparison, compare
from .targets import Target, register
from .training import TrainSpec, standard_step

__version__ = "0.1.0"

__all__ = ["CONFIGS", "Config", "FORMATS", "format_of", "ulp", "ulp_distance", "Comparison", "compare",
           "Target", "register", "TrainSpec", "standard_step", "TensorCoreAlignmentWarning", "tensor_core_misalignments", "__version__"]

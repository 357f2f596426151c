"""pytest-precision: numerical regression checks for softmax, attention and training code.

Register targets from a ``conftest.py``::

    import pytest_precision
    pytest_precision.register("my_softmax", my_softmax, kind="softmax")

and run ``pytest --precision-suite``. New kinds: subclass :class:`Kind` and
``pytest_precision.register_kind(MY_KIND)``.

The package is layered (each layer imports only those before it): ``platform`` (the machine:
devices, Triton's runtime, the interpreter's bf16), ``numerics`` (formats, ULPs, metrics, budgets,
configs, inputs), ``baselines`` (files, the golden lifecycle, usage,
tools), ``explain`` (tracing, first fault, audit) and ``speed`` (timing, the gate, alignment),
``training`` (the train_step contract, runs, comparisons, DDP), ``kinds`` (the Kind interface,
outcomes, registries), ``reporting`` (summary, reports, plots), ``runner`` (options, collection,
fixtures, outputs), then ``plugin``. The built-in kinds are in ``pytest_precision.suites``, the
Triton kernels in ``pytest_precision.kernels``; no layer imports them.
"""
from .kinds.base import Case, DrawnRegime, Kind, OutputRule, Regime, Variant
from .kinds.registry import Target, register, register_kind
from .platform.triton import needs_triton
from .numerics.configs import CONFIGS, Config
from .numerics.formats import FORMATS, format_of, ulp, ulp_distance
from .numerics.metrics import Comparison, compare
from .speed.alignment import TensorCoreAlignmentWarning, tensor_core_misalignments
from .training.spec import TrainSpec, standard_step

__version__ = "0.1.0"

__all__ = ["CONFIGS", "Config", "FORMATS", "format_of", "ulp", "ulp_distance", "Comparison", "compare",
           "Target", "register", "register_kind", "Kind", "Case", "Regime", "DrawnRegime", "Variant", "OutputRule",
           "needs_triton", "TrainSpec", "standard_step", "TensorCoreAlignmentWarning", "tensor_core_misalignments",
           "__version__"]

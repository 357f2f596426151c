"""pytest-precision: numerical regression checks for softmax, attention and training code.

Register targets from a ``conftest.py``::

    import pytest_precision
    pytest_precision.register("my_softmax", my_softmax, kind="softmax")

and run ``pytest --precision-suite``. New kinds: subclass :class:`TensorKind` (targets that return a
tensor; :class:`Kind` is the seam alone) and ``pytest_precision.register_kind(MY_KIND)``; check
them with ``pytest_precision.testing.check_kind``.

The package is layered (each layer imports only those before it): ``platform`` (the machine:
devices, Triton's runtime, the interpreter's bf16), ``numerics`` (formats, ULPs, metrics, budgets,
configs, inputs), ``baselines`` (files, the golden lifecycle, usage,
tools), ``explain`` (tracing, first fault, audit) and ``speed`` (timing, the gate, alignment),
``training`` (the train_step contract, runs, comparisons, DDP), ``kinds`` (the Kind seam, the
TensorKind template, cases, outcomes, registries), ``reporting`` (summary, reports, plots), ``runner`` (options, collection,
fixtures, outputs), then ``plugin``. The built-in kinds are in ``pytest_precision.suites``, the
Triton kernels in ``pytest_precision.kernels``; no layer imports them.
"""
import importlib.util as _util
import os as _os

# run from a source checkout that is not installed (PYTHONPATH=., as on a lent GPU machine, .ci/gpu):
# the built-in suites and kernels sit beside the package, where pyproject's package-dir maps them
_SOURCE_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_SOURCE_ROOT, "suites", "__init__.py")) and _util.find_spec(__name__ + ".suites") is None:
    __path__.append(_SOURCE_ROOT)

from .kinds.cases import Case, DrawnRegime, Regime, Variant  # noqa: E402
from .kinds.kind import Kind
from .kinds.tensor.measurement import MeasureContext, OutputRule
from .kinds.tensor import TensorKind
from .kinds.registry import Target, register, register_kind
from .platform.triton import needs_triton
from .numerics.configs import CONFIGS, Config
from .numerics.formats import FORMATS, format_of, ulp, ulp_distance
from .numerics.metrics import Comparison, compare
from .speed.alignment import TensorCoreAlignmentWarning, tensor_core_misalignments
from .training.spec import TrainSpec, standard_step

__version__ = "0.1.0"

__all__ = ["CONFIGS", "Config", "FORMATS", "format_of", "ulp", "ulp_distance", "Comparison", "compare",
           "Target", "register", "register_kind", "Kind", "TensorKind", "Case", "Regime", "DrawnRegime", "Variant", "OutputRule",
           "MeasureContext",
           "needs_triton", "TrainSpec", "standard_step", "TensorCoreAlignmentWarning", "tensor_core_misalignments",
           "__version__"]

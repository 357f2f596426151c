"""Kinds of targets, and the one surface a kind author imports from: ``pytest_precision.kinds``.

A kind (the built-in ones in ``suites/`` are written this way, and ``tests/test_public_surface.py``
holds them to it) imports what it needs from this package's namespace, never from its modules:

- the seam: :class:`Kind`, :func:`skip`; the template of kinds whose targets return a tensor,
  :class:`TensorKind`; the registries (:func:`register`, :func:`register_kind`, :func:`get_kind`,
  :func:`kinds`);
- cases: :class:`Case`, :class:`Regime`, :class:`DrawnRegime`, :class:`Variant`, ``NO_VARIANT``;
  the fresh regime's :class:`Plan`; what targets may declare (:class:`Declaration`,
  :func:`declared_dtypes`, :func:`declared_flag`); :class:`Target` and :class:`TargetError`;
- judging: :class:`OutputRule` (a :class:`ComparisonSpec`, the one the golden keeps, with the peer
  budget's factor and floors) read from a :class:`MeasureContext`; the budgets' factors and
  floors (``PEER_FACTOR``, ``GRAD_PEER_FACTOR``, ``ULP_FLOOR``, :func:`abs_floor`,
  :func:`sum_chain`); formats (:func:`format_of`, :func:`ulp`), :func:`compare`, :func:`float32_as_float64`; inputs
  (:func:`seeded_normal`, :func:`portable_normal_draws`);
- results: :class:`Outcome`, :class:`Evidence`, :class:`Problem`, :class:`PrecisionFailure`,
  :func:`baseline_problems`, the summary tables (:class:`SummaryTable`, ``ABS_ERROR_TABLE``,
  :func:`fmt`), :class:`RunState` and the typed :class:`Memo` s a kind keeps in it; names in golden paths (:func:`file_component`,
  :func:`name_problem`), :func:`format_seconds`;
- what a kind's run is handed and what it reads beyond the outcome: :class:`BaselineCheck` (the
  golden's check) and its :class:`BaselineResult`; a failing case's first fault (:class:`Fault`,
  :func:`first_fault`, :class:`OpTracer`, :func:`tracing`); :class:`RngState` (torch's generators,
  to replay a call); Triton (:func:`uses_triton`, :func:`triton_error`, :func:`bf16_as_on_gpu`,
  :func:`as_harness`).

A kind driving the training engine imports it from ``pytest_precision.kinds.training`` (the
train_step kind, ``suites/training.py`` and the modules it names, does), a thin re-export that is
not imported with this package.

The modules behind it are internal: they move and change without notice. The tensor template
and its machinery are the folder ``tensor/`` (its own docstring lists them).

- ``kind``: the seam (identity, targets, declarations, the case matrix, and the ``run`` /
  ``bench_call`` / ``trace_call`` each kind implements);
- ``registry``: the kinds and targets of a session; ``target``: a registered target;
- ``target_code``: a digest of a target's code, which its fresh seed is derived from;
- ``cases``: regimes, variants and the :class:`Case`;
- ``fresh``: the fresh regime and the seeds of the drawn one;
- ``declarations``: what targets may declare (dtypes, flags), and a declaration a run found one needs;
- ``session``: :class:`RunState`, what one session's cases learn for the next, and its typed memos;
- ``compiled``: the ``+compiled`` variant;
- ``outcome``: a case's outcome and message; ``record``: the typed record of one suite case;
- ``tables``: the summary tables; ``details``: per-case report detail;
- ``training``: the training engine's surface for a kind built on it (public, above).
"""
from ..baselines.entry import BaselineResult
from ..baselines.lifecycle import BaselineCheck
from ..baselines.store import file_component, name_problem
from ..explain.faults import Fault, first_fault
from ..explain.tracing import OpTracer, tracing
from ..numerics.budgets import GRAD_PEER_FACTOR, PEER_FACTOR, ULP_FLOOR, abs_floor, sum_chain
from ..numerics.formats import format_of, ulp
from ..numerics.inputs import portable_normal_draws, seeded_normal
from ..numerics.metrics import compare
from ..numerics.promote import float32_as_float64
from ..numerics.rng import RngState
from ..platform.launches import as_harness
from ..platform.triton import bf16_as_on_gpu, triton_error, uses_triton
from ..speed.timing import format_seconds
from .cases import NO_VARIANT, Case, DrawnRegime, Regime, Variant
from .declarations import Declaration, declared_dtypes, declared_flag
from .fresh import Plan
from .kind import Kind, skip
from ..numerics.metrics import ComparisonSpec
from .tensor.measurement import MeasureContext, OutputRule
from .outcome import Evidence, Outcome, PrecisionFailure, Problem, baseline_problems
from .registry import get_kind, kinds, register, register_kind
from .session import Memo, RunState
from .tables import ABS_ERROR_TABLE, SummaryTable, fmt
from .target import Target, TargetError
from .tensor import TensorKind

__all__ = [
    # the seam, the tensor template, the registries
    "Kind", "skip", "TensorKind", "register", "register_kind", "get_kind", "kinds",
    # cases and what targets declare
    "Case", "Regime", "DrawnRegime", "Variant", "NO_VARIANT", "Plan", "Declaration", "declared_dtypes",
    "declared_flag", "Target", "TargetError",
    # judging
    "OutputRule", "ComparisonSpec", "MeasureContext", "PEER_FACTOR", "GRAD_PEER_FACTOR", "ULP_FLOOR", "abs_floor", "sum_chain", "format_of", "ulp",
    "compare", "float32_as_float64", "seeded_normal", "portable_normal_draws",
    # results
    "Outcome", "Evidence", "Problem", "PrecisionFailure", "baseline_problems", "SummaryTable", "ABS_ERROR_TABLE", "fmt",
    "RunState", "Memo", "file_component", "name_problem", "format_seconds",
    # what a kind's run is handed and gives back beyond its outcome: the golden's check, the first
    # fault of a failing case (tracing), torch's random state to replay a call, Triton's
    "BaselineCheck", "BaselineResult", "Fault", "first_fault", "OpTracer", "tracing", "RngState",
    "uses_triton", "triton_error", "bf16_as_on_gpu", "as_harness",
]

"""Kinds of targets and the seam they go through:

- ``kind``: :class:`Kind`, the seam (identity, targets, declarations, the case matrix, and the
  ``run`` / ``bench_call`` / ``trace_call`` each kind implements);
- ``tensor``: :class:`TensorKind`, the template of kinds whose targets return a tensor, judged
  from small hooks;
- ``measurement``: the context ``output_rule`` reads, output rules, measurements, tensor evidence;
- ``drawn``: the drawn regime's Hypothesis search;
- ``fault``: a failing case's first fault;
- ``cases``: regimes, variants and the :class:`Case`;
- ``session``: :class:`RunState`, what one session's cases learn for the next;
- ``declarations``: what targets may declare (dtypes, flags), and a declaration a run found one needs;
- ``compiled``: the ``+compiled`` variant;
- ``outcome``: a case's outcome and message;
- ``record``: the typed record of one suite case;
- ``tables``: the summary tables; ``details``: per-case report detail;
- ``registry``: the kinds and targets of a session; ``target``: a registered target;
- ``target_call``: one call of a target on copies of its inputs, the one place every call goes through;
- ``target_code``: a digest of a target's code, which its fresh seed is derived from;
- ``fresh``: the fresh regime and the seeds of the drawn one;
- ``contract``: the callable's contract beyond its values (inputs left alone, a plain fresh output, a
  second call, degenerate regimes); ``contract_checks``: the checks a case runs after its measurement;
- ``batch``: the batch-invariance probes."""
from .cases import NO_VARIANT, Case, DrawnRegime, Regime, Variant
from .kind import Kind
from .measurement import MeasureContext, OutputRule
from .outcome import Evidence, Outcome, PrecisionFailure, Problem
from .registry import get_kind, kinds, register, register_kind
from .session import RunState
from .target import Target, TargetError
from .tensor import TensorKind

__all__ = ["Kind", "TensorKind", "Case", "Regime", "DrawnRegime", "Variant", "NO_VARIANT", "OutputRule",
           "MeasureContext", "RunState", "Outcome", "Problem", "Evidence", "PrecisionFailure", "Target", "TargetError",
           "register", "register_kind", "get_kind", "kinds"]

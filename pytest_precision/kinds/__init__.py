"""Kinds of targets and the seam they go through: the :class:`Kind` interface (``base``), the
outcome of a case (``outcome``), the registries of kinds and targets (``registry``), summary
tables (``tables``)."""
from .base import NO_VARIANT, Case, DrawnRegime, Kind, OutputRule, Regime, Variant
from .outcome import Evidence, Outcome, PrecisionFailure, Problem
from .registry import get_kind, kinds, register, register_kind
from .target import Target, TargetError

__all__ = ["Kind", "Case", "Regime", "DrawnRegime", "Variant", "NO_VARIANT", "OutputRule", "Outcome", "Problem",
           "Evidence", "PrecisionFailure", "Target", "TargetError", "register", "register_kind", "get_kind", "kinds"]

"""The tensor template: :class:`TensorKind` and its machinery (internal; a kind author imports
``TensorKind`` from ``pytest_precision.kinds``).

- ``template``: :class:`TensorKind`, its core hooks and its final template methods;
- ``roles``: the hooks grouped by role, each with its defaults: drawn inputs, batch invariance,
  conventions and declarations, golden inputs;
- ``measurement``: the context ``output_rule`` reads, output rules, measurements (one result per
  output), tensor evidence;
- ``target_call``: one call of a target, with what it must not change; ``contract`` and
  ``contract_checks``: the calling contract a target must keep; ``batch``: batch invariance;
- ``drawn``: the drawn regime's Hypothesis search; ``fault``: a failing case's first fault.
"""
from .template import TEMPLATE_METHODS, CaseInputs, TensorKind

__all__ = ["TensorKind", "CaseInputs", "TEMPLATE_METHODS"]

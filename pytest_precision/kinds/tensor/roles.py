"""The tensor template's hooks grouped by role, each role a mixin with its defaults, so that a kind
author reads the core (``template.TensorKind``: inputs, the calling convention, numerics) apart from
what only some kinds say:

- :class:`DrawnInputs`: the drawn regime's examples (a kind with a ``DrawnRegime``; ``drawn``);
- :class:`BatchInvariance`: how to take rows, for kinds whose rows are independent (``batch``);
- :class:`Conventions`: declarations a target may make, and what a failing case may have meant;
- :class:`GoldenInputs`: what a golden records of a case's inputs.

``TensorKind`` takes all four, with these defaults; a kind overrides the hooks of the roles it has.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .contract import CONTRACT_DECLARATIONS, normalise_contract

if TYPE_CHECKING:
    from ..cases import Case, Regime
    from ..declarations import Declaration
    from ..target import Target
    from .measurement import Measurement

__all__ = ["DrawnInputs", "BatchInvariance", "Conventions", "GoldenInputs"]


class DrawnInputs:
    """The drawn regime's examples: ``draw`` is required of a kind with a ``DrawnRegime``."""

    def draw(self, case: Case):
        """The Hypothesis strategy of the drawn regime's examples for ``case``."""
        raise NotImplementedError

    def drawn_inputs(self, example: Any) -> Any:
        return example

    def describe_drawn(self, example: Any, case: Case) -> list[str]:
        return [f"Hypothesis found (after shrinking) {example!r}"]

    def known_limit(self, case: Case, example: Any, m: Measurement) -> str | None:
        """Why a drawn input on which ``case`` failed lies at a known limit of the built-in target
        (torch's op), making the failure expected: its reason, or None (checked before the first
        fault is looked for)."""
        return None


class BatchInvariance:
    """Rows a batch's result must not depend on the rest of (``batch``): a kind whose rows are
    independent says how many (``batch_size``) and how to take them (``rows_of``)."""

    def batch_size(self, case: Case, inputs: Any, values: dict[str, torch.Tensor]) -> int | None:
        """The number of independent rows of ``inputs``, or None where rows are not independent."""
        return None

    def rows_of(self, case: Case, inputs: Any, values: dict[str, torch.Tensor], rows: torch.Tensor) -> tuple:
        raise NotImplementedError  # (inputs, values) restricted to ``rows`` of the batch (repeated ones repeat)

    batch_gradients = False  # the probes' calls take gradients too (row_results reads one)

    def row_results(self, case: Case, inputs: Any, outputs: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The per-row result of a call's ``outputs`` that the batch probes compare: the forward output."""
        return outputs[self.forward_output]

    def output_rows(self, case: Case, inputs: Any, out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` of a per-row result ``out`` (its first dimension by default)."""
        return out.index_select(0, rows.to(out.device))


class Conventions:
    """What a target may declare (dtypes, flags, features it lacks) and the conventions under which
    a failing case may be what it does by design."""

    def normalise_declaration(self, name: str, key: str, value: Any) -> Any:
        if key in CONTRACT_DECLARATIONS:
            return normalise_contract(name, key, value)
        return super().normalise_declaration(name, key, value)

    def hint(self, case: Case, m: Measurement, inputs: Any) -> str | None:
        """A line for a failing case's message when the kind can tell what the target may have
        meant (attention: the other causal alignment), else None."""
        return None

    def conventions(self, case: Case, m: Measurement, inputs: Any) -> list[tuple[Declaration, str]]:
        """Declarations under which a failing case's outputs may be what the target does by design (a
        fully masked row's mean of v, another causal alignment), each with the sentence that says
        what the target did: ``run`` judges the case again under each, and one under which it passes
        (or is skipped) turns its oracle problems into one ``convention`` problem naming it."""
        return []

    def feature_declarations(self, target: Target) -> list[Declaration]:
        """Declarations of what a target does not support (``grouped_query=False``), each skipping
        the inputs that have the feature: a target raising on inputs that one of them would skip
        fails ``unsupported`` (a regime of that one feature) naming it, not ``crash``."""
        return []

    def skipping_declarations(self, target: Target) -> list[Declaration]:
        """Every declaration that skips regimes (``feature_declarations`` and conventions that do, as
        attention's ``causal_only``): each case records which would skip it."""
        return self.feature_declarations(target)


class GoldenInputs:
    """What a golden records of a case's inputs besides their values."""

    def input_spec(self, regime: Regime, inputs: Any) -> dict:
        """What the golden records of the inputs besides their checksum."""
        return {"regime": regime.name, "seed": regime.seed, **regime.parameters}

    def checksum_input(self, inputs: Any) -> torch.Tensor:
        """The tensor whose checksum the golden keeps: every floating input, flattened."""
        return torch.cat([t.flatten() for t in self.floating_inputs(inputs).values()])

    def magnitude_input(self, inputs: Any) -> torch.Tensor | None:
        """Inputs whose magnitude the reports profile the error against (softmax's logits), or None."""
        return None

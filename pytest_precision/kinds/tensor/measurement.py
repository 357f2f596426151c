"""What a tensor kind measures in one case: the :class:`MeasureContext` its ``output_rule`` reads,
the :class:`OutputRule` of each output (how it is compared), the :class:`Measurement` (the target,
the peer and the oracle, compared) and the :class:`TensorEvidence` an outcome carries."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...baselines.tensors import TensorOutput
from ...numerics.budgets import ULP_FLOOR, Budget, peer_budget, violations
from ...numerics.describe import Held, comparison_lines
from ...numerics.metrics import Comparison, ComparisonSpec
from ...numerics.rng import RngState
from ..outcome import Evidence

__all__ = ["MeasureContext", "OutputRule", "OutputResult", "Measurement", "TensorEvidence", "upstream_gradient"]


def upstream_gradient(shape, seed: int) -> torch.Tensor:
    """The seeded upstream gradient the outputs' gradients are taken under (float64, CPU)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@dataclass(kw_only=True)
class OutputRule(ComparisonSpec):
    """How one output is compared: its :class:`ComparisonSpec` (the dtype whose ULPs count, the
    scale, the floors; the golden keeps the same spec), the output and the peer's as compared (fp8
    dequantised, ``scale`` and ``peer_scale`` theirs), and the peer budget's factor and floors."""

    out: torch.Tensor
    peer: torch.Tensor
    peer_scale: float = 1.0
    peer_factor: float = 2.0
    ulp_floor: float = ULP_FLOOR  # the peer budget's floor on ULP-judged outputs
    # set (abs_floor set too): the peer budget also limits the RMS error to peer_rms_factor (None:
    # peer_factor) x the peer's plus this floor (a systematic loss, such as a sum kept in 16 bits,
    # shows there first); ``careful_rms``: an RMS error the limit never counts the peer's below (a
    # second careful implementation's, where best practice rounds more often than the peer does)
    peer_rms_floor: float | None = None
    peer_rms_factor: float | None = None
    careful_rms: float = 0.0

    def oracle(self, ref: torch.Tensor) -> Comparison:
        """The output against the oracle's ``ref``."""
        return self.compare(self.out, ref)

    def peer_oracle(self, ref: torch.Tensor) -> Comparison:
        """The peer's output against the oracle's ``ref``."""
        return self.compare(self.peer, ref, scale=self.peer_scale)

    def budget(self, peer: Comparison) -> Budget:
        """The budget a comparison with the same oracle sets this output: ``peer_factor`` x its error
        plus the floors."""
        if self.abs_floor is None:
            return peer_budget(peer, self.peer_factor, self.ulp_floor)
        return peer_budget(peer, self.peer_factor, abs_floor_value=self.abs_floor, rms_floor_value=self.peer_rms_floor,
                           rms_factor=self.peer_rms_factor, careful_rms=self.careful_rms)


@dataclass
class OutputResult:
    """One output of a measurement, compared: the target's against the oracle (``oracle``), the peer's
    (``peer``) and the budget that sets (``peer_budget``), the golden's entry (``golden``); in a compiled
    case, the same target run eagerly against the oracle and the budget it sets (``eager``,
    ``eager_budget``: ``Variant.beside``)."""

    oracle: Comparison
    peer: Comparison
    peer_budget: Budget
    golden: TensorOutput
    eager: Comparison | None = None
    eager_budget: Budget | None = None


@dataclass
class Measurement:
    """A case's run on one set of inputs: the target, the peer and the oracle, compared, one
    :class:`OutputResult` per output (``results``, the forward output's first)."""

    values: dict[str, torch.Tensor]  # inputs as the config feeds them
    exact: dict[str, torch.Tensor]  # the same rounded values in float64 (CPU)
    outputs: dict[str, torch.Tensor]  # the target's, as returned
    peer_name: str = ""
    launches: list = field(default_factory=list)  # interpreted Triton kernels the target's call launched
    rng_state: RngState | None = None  # torch's generators as the target's call started (a re-run replays them)
    results: dict[str, OutputResult] = field(default_factory=dict)
    # the callable's contract (kinds.tensor.contract): (category, sentence) of each breach, what a second
    # call on the same inputs gave (contract.Spread), the batch probes (batch.BatchSpread), notes
    contract: list[tuple[str, str]] = field(default_factory=list)
    spread: Any = None
    batch: Any = None
    notes: list[str] = field(default_factory=list)

    @property
    def lost(self) -> bool:
        """Whether an output holds a non-finite value (where the first fault is worth naming)."""
        return not all(bool(torch.isfinite(t).all()) for t in self.outputs.values())

    def failed_outputs(self) -> set[str]:
        """The outputs over their peer budget or counts."""
        return {n for n, r in self.results.items() if violations(r.oracle, r.peer_budget)}

    def goldens(self) -> dict[str, TensorOutput]:
        """Each output's golden entry, as the baseline check takes them."""
        return {n: r.golden for n, r in self.results.items()}


class TensorEvidence(Evidence):
    """What a tensor kind measured: every output against the oracle and the peer."""

    def __init__(self, m: Measurement, magnitude_input: torch.Tensor | None = None):
        self.results = m.results
        self.spread, self.batch, self.notes = m.spread, m.batch, m.notes
        self.peer_name = m.peer_name
        self.magnitude_input = magnitude_input

    @property
    def forward(self) -> Comparison:
        return next(iter(self.results.values())).oracle

    def record_fields(self, outcome) -> dict:
        o, every = self.forward, [r.oracle for r in self.results.values()]
        fields = {"max_ulp": o.max_ulp, "max_abs": o.max_abs, "rms_abs": o.rms_abs, "max_rel": o.max_rel,
                  "sqnr_db": o.sqnr_db, "overflow": sum(c.overflow for c in every),
                  "underflow": sum(c.underflow for c in every), "nan": sum(c.nan for c in every)}
        eager = next(iter(self.results.values())).eager
        if eager is not None:
            fields.update(eager_max_ulp=eager.max_ulp, eager_max_abs=eager.max_abs)
        if self.spread is not None:
            fields.update(rerun_differing=self.spread.total, rerun_max_ulp=self.spread.max_ulp())
        if self.batch is not None:
            fields.update(batch_differing=self.batch.total)
        return fields

    def report_fields(self, outcome) -> dict:
        from ..details import error_by_magnitude, output_detail

        fields = {"outputs": {name: output_detail(name, self, outcome.baseline) for name in self.results}}
        if self.magnitude_input is not None:
            fields["error_by_magnitude"] = error_by_magnitude(self.forward, self.magnitude_input)
        return fields

    def message_lines(self, outcome) -> list[str]:
        lines = [f"  note: {n}" for n in self.notes]
        if self.batch is not None and self.batch.total and "batch_variant" not in outcome.categories:
            lines.append(f"  note: its rows depend on the batch around them ({self.batch.describe()}; not judged: "
                         "declare batch_invariant=True to require the same bits)")
        several = len(self.results) > 1
        for name, r in self.results.items():
            o, pb = r.oracle, r.peer_budget
            held = [Held.peer(self.peer_name, r.peer, pb)]
            held += [Held.compiled(r.eager, r.eager_budget)] if r.eager is not None and r.eager_budget is not None else []
            failed = any(p.check == "oracle" and p.sentence.startswith(f"oracle: {name}:") for p in outcome.problems)
            lines += comparison_lines(o, "the float64 oracle on the rounded inputs", name=name if several else None,
                                      judged_on="abs" if pb is not None and pb.max_abs is not None else "ulp",
                                      held=held, worst=not several or failed)
        return lines


@dataclass
class MeasureContext:
    """What one measurement of a case knows, handed to the kind's ``output_rule``: the case, its
    inputs as the target reads them, the rounded inputs in float64 (``exact``), the seed of the
    upstream gradient, what the kind computed once for this measurement (``facts``, from
    ``TensorKind.rule_facts``: norm's sensitivity, the op kind's moved exact result) and the rules
    of the outputs compared so far (``rules``, the forward output's first). Made per measurement,
    so nothing of one case is left on the kind or the inputs for the next."""

    case: "Case"  # kinds.cases.Case (which names this class in its annotations)
    inputs: Any
    exact: dict[str, torch.Tensor]
    grad_seed: int = 0
    facts: Any = None
    rules: dict[str, "OutputRule"] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what output_rule decided that the message should say

    def upstream(self, shape) -> torch.Tensor:
        """The upstream gradient of an output of ``shape`` in this measurement."""
        return upstream_gradient(shape, self.grad_seed)

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
from ...numerics.metrics import Comparison, compare
from ...numerics.rng import RngState
from ..outcome import Evidence

__all__ = ["MeasureContext", "OutputRule", "Measurement", "TensorEvidence", "upstream_gradient"]


def upstream_gradient(shape, seed: int) -> torch.Tensor:
    """The seeded upstream gradient the outputs' gradients are taken under (float64, CPU)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@dataclass
class OutputRule:
    """How one output is compared: the output and the peer's as compared (fp8 dequantised), the
    dtype whose ULPs count, the peer budget's factor and floor. ``abs_floor`` set: budgets on
    absolute error, never below that max error nor ``rms_floor`` RMS error (what a correct
    implementation can reach under another summation order; outputs that cross zero); None: on ULPs."""

    out: torch.Tensor
    peer: torch.Tensor
    dtype: torch.dtype
    scale: float = 1.0
    peer_scale: float = 1.0
    peer_factor: float = 2.0
    ulp_floor: float = ULP_FLOOR  # the peer budget's floor on ULP-judged outputs
    abs_floor: float | None = None
    rms_floor: float | None = None
    underflow_floor: float = 0.0
    log_domain: bool = False
    # set (abs_floor set too): the peer budget also limits the RMS error to peer_rms_factor (None:
    # peer_factor) x the peer's plus this floor (a systematic loss, such as a sum kept in 16 bits,
    # shows there first); ``careful_rms``: an RMS error the limit never counts the peer's below (a
    # second careful implementation's, where best practice rounds more often than the peer does)
    peer_rms_floor: float | None = None
    peer_rms_factor: float | None = None
    careful_rms: float = 0.0

    def oracle(self, ref: torch.Tensor) -> Comparison:
        """The output against the oracle's ``ref``."""
        return compare(self.out, ref, self.dtype, scale=self.scale, log_domain=self.log_domain,
                       underflow_floor=self.underflow_floor)

    def budget(self, peer: Comparison) -> Budget:
        """The budget a comparison with the same oracle sets this output: ``peer_factor`` x its error
        plus the floors."""
        if self.abs_floor is None:
            return peer_budget(peer, self.peer_factor, self.ulp_floor)
        return peer_budget(peer, self.peer_factor, abs_floor_value=self.abs_floor, rms_floor_value=self.peer_rms_floor,
                           rms_factor=self.peer_rms_factor, careful_rms=self.careful_rms)


@dataclass
class Measurement:
    """A case's run on one set of inputs: the target, the peer and the oracle, compared."""

    values: dict[str, torch.Tensor]  # inputs as the config feeds them
    exact: dict[str, torch.Tensor]  # the same rounded values in float64 (CPU)
    outputs: dict[str, torch.Tensor]  # the target's, as returned
    peer_name: str = ""
    launches: list = field(default_factory=list)  # interpreted Triton kernels the target's call launched
    rng_state: RngState | None = None  # torch's generators as the target's call started (a re-run replays them)
    oracle: dict[str, Comparison] = field(default_factory=dict)
    peer: dict[str, Comparison] = field(default_factory=dict)
    peer_budget: dict[str, Budget] = field(default_factory=dict)
    golden: dict[str, TensorOutput] = field(default_factory=dict)
    # a compiled case: the same target run eagerly in the same config, against the oracle, and the
    # budget it sets the compiled output (Variant.beside)
    eager: dict[str, Comparison] = field(default_factory=dict)
    eager_budget: dict[str, Budget] = field(default_factory=dict)
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
        return {n for n in self.oracle if violations(self.oracle[n], self.peer_budget[n])}


class TensorEvidence(Evidence):
    """What a tensor kind measured: every output against the oracle and the peer."""

    def __init__(self, m: Measurement, magnitude_input: torch.Tensor | None = None):
        self.oracle, self.peer, self.peer_budget = m.oracle, m.peer, m.peer_budget
        self.eager, self.eager_budget = m.eager, m.eager_budget
        self.spread, self.batch, self.notes = m.spread, m.batch, m.notes
        self.peer_name = m.peer_name
        self.magnitude_input = magnitude_input

    @property
    def forward(self) -> Comparison:
        return next(iter(self.oracle.values()))

    def record_fields(self, outcome) -> dict:
        o, every = self.forward, self.oracle.values()
        fields = {"max_ulp": o.max_ulp, "max_abs": o.max_abs, "rms_abs": o.rms_abs, "max_rel": o.max_rel,
                  "sqnr_db": o.sqnr_db, "overflow": sum(c.overflow for c in every),
                  "underflow": sum(c.underflow for c in every), "nan": sum(c.nan for c in every)}
        eager = self.eager.get(next(iter(self.oracle)))
        if eager is not None:
            fields.update(eager_max_ulp=eager.max_ulp, eager_max_abs=eager.max_abs)
        if self.spread is not None:
            fields.update(rerun_differing=self.spread.total, rerun_max_ulp=self.spread.max_ulp())
        if self.batch is not None:
            fields.update(batch_differing=self.batch.total)
        return fields

    def report_fields(self, outcome) -> dict:
        from ..details import error_by_magnitude, output_detail

        fields = {"outputs": {name: output_detail(name, self, outcome.baseline) for name in self.oracle}}
        if self.magnitude_input is not None:
            fields["error_by_magnitude"] = error_by_magnitude(self.forward, self.magnitude_input)
        return fields

    def message_lines(self, outcome) -> list[str]:
        lines = [f"  note: {n}" for n in self.notes]
        if self.batch is not None and self.batch.total and "batch_variant" not in outcome.categories:
            lines.append(f"  note: its rows depend on the batch around them ({self.batch.describe()}; not judged: "
                         "declare batch_invariant=True to require the same bits)")
        several = len(self.oracle) > 1
        for name, o in self.oracle.items():
            peer, pb = self.peer.get(name), self.peer_budget.get(name)
            eager, eb = self.eager.get(name), self.eager_budget.get(name)
            held = [Held.peer(self.peer_name, peer, pb)] if peer is not None and pb is not None else []
            held += [Held.compiled(eager, eb)] if eager is not None and eb is not None else []
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
